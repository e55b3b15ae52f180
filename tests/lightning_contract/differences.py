"""Where ``mixed_fsdp2`` deliberately differs from Lightning's ``ModelParallelStrategy``: the ported test of each is
skipped for our classes (it still runs for Lightning's) and replaced by a test in ``test_differences.py`` that asserts
our documented behaviour. docs/configuration.md's "Differences from ModelParallelStrategy" lists the same entries."""

from typing import Dict, Optional, Tuple

# ported test name -> (why we differ, the replacement test in tests/lightning_contract/test_differences.py)
DIFFERENCES: Dict[str, Tuple[str, str]] = {
    "test_torch_greater_equal_2_4": (
        "Lightning builds the message from type(self).__name__; the test hard-codes its own class name",
        "test_messages_name_our_class",
    ),
    "test_save_checkpoint_storage_options": (
        "Lightning builds the message from type(self).__name__; the test hard-codes its own class name",
        "test_messages_name_our_class",
    ),
    "test_load_checkpoint_no_state": (
        "Lightning builds the message from type(self).__name__; the test hard-codes its own class name",
        "test_messages_name_our_class",
    ),
    "test_parallelize_fn_call": (
        "setup_module plans and shards the module parallelize_fn returns, so it needs launched processes and a real"
        " module (the test mocks both)",
        "test_parallelize_fn_is_called_with_the_mesh_and_its_module_is_sharded",
    ),
    "test_no_backward_sync": (
        "leaving no_backward_sync(enabled=False) restores gradient sync; Lightning's leaves it off",
        "test_no_backward_sync_restores_gradient_sync_either_way",
    ),
    "test_save_checkpoint_path_exists": (
        "saves are atomic (written beside the path, committed by rename) and never delete a file they did not"
        " write; the test mocks torch.save and shutil inside Lightning's in-place save",
        "test_atomic_saves_over_existing_paths_keep_user_files",
    ),
    "test_meta_device_materialization": (
        "no param leaves setup uninitialised: a module no init covers raises naming it (Lightning warns and leaves"
        " uninitialised memory); the test also mocks the mesh",
        "test_a_meta_module_without_an_init_is_refused_and_the_rest_materialised",
    ),
    "test_configure_model_required": (
        "configure_model is optional: the dtype plan shards every child of the LightningModule",
        "test_the_trainer_shards_children_without_configure_model",
    ),
    "test_tensor_parallel": (
        "tensor_parallel_size defaults to 1 (Lightning: 'auto', the devices of a node), and the plan shards with"
        " FSDP over the data-parallel mesh even when it has one rank, so TP params are 2-D DTensors",
        "test_tensor_parallelism_with_lightnings_auto_sizes",
    ),
    "test_clip_gradients[norm]": (
        "clipping by norm is ours, over grads that mix Shard and Replicate placements and dtypes; Lightning skips its"
        " own test ('Gradient clipping by norm is not correct': it clips to the norm the grads already have)",
        "test_clip_gradients_by_norm_reaches_the_requested_norm_over_mixed_placements",
    ),
    "test_module_init_context[16-true]": (
        "fp16 is refused: FSDP2 has no sharded gradient scaler",
        "test_fp16_is_refused_with_the_fix",
    ),
}


def difference_of(name: str) -> Optional[Tuple[str, str]]:
    """The entry for a test node name (``test_x[mixed-...]``): by function name, or function name plus a parameter
    that appears in the node's id."""
    function, _, params = name.partition("[")
    for key, entry in DIFFERENCES.items():
        key_function, _, key_param = key.partition("[")
        if key_function == function and (not key_param or f"-{key_param.rstrip(']')}-" in f"-{params.rstrip(']')}-"):
            return entry
    return None
