"""The heart: which tensors stay fp32 (matching), every tensor's dtype and FSDP group (plan, report), executing the
plan (apply, replicate), and what training needs on top (clip, mesh)."""
