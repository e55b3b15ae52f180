"""Pipeline stages planned without processes: the options' refusals (every problem at once), the balanced and the
named splits of HF decoders and of block-list models, the mesh sizes."""

from typing import Any, List

import pytest
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.mesh import ParallelDims
from lightning_mixedfsdp.planning.stages import plan_stages, stages_of_rank
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig
from tests.hf_models import tiny_model

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends


def problems(**options: Any) -> List[str]:
    return MixedFSDPConfig(**options).problems()


OPTION_REFUSALS = {
    "schedule": (
        dict(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble"),
        "parallelism.pipeline_schedule='ZBVZeroBubble' is not supported; use one of ['1F1B', 'GPipe',"
        " 'Interleaved1F1B'].",
    ),
    "one_stage_interleaved": (
        dict(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=1),
        "pipeline_schedule='Interleaved1F1B' runs several stages per rank and pipeline_stages_per_rank=1; set"
        " pipeline_stages_per_rank=2",
    ),
    "two_stages_1f1b": (
        dict(pipeline_parallel_size=2, pipeline_stages_per_rank=2),
        "pipeline_schedule='1F1B' runs one stage per rank and pipeline_stages_per_rank=2",
    ),
    "too_few_microbatches": (
        dict(pipeline_parallel_size=4, pipeline_microbatches=2),
        "pipeline_microbatches=2 is fewer than 1F1B needs (at least pipeline_parallel_size=4",
    ),
    "rounds": (
        dict(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_microbatches=5),
        "pipeline_microbatches=5 does not split into Interleaved1F1B's 2 rounds",
    ),
    "context_parallel": (
        dict(pipeline_parallel_size=2, context_parallel_size=2),
        "pipeline_parallel_size=2 with context_parallel_size=2 is not supported yet",
    ),
    "semi_sync": (
        dict(pipeline_parallel_size=2, data_parallel_replicate_size=2, replicate_sync="diloco"),
        "pipeline_parallel_size=2 with replicate_sync='diloco' is not supported yet",
    ),
    "fault_tolerance": (
        dict(pipeline_parallel_size=2, fault_tolerance={"replica_id": 0, "num_replica_groups": 2}),
        "parallelism.pipeline_parallel_size=2 with fault_tolerance is not supported yet",
    ),
}


@pytest.mark.parametrize("case", list(OPTION_REFUSALS))
def test_each_pipeline_option_refusal_names_the_fix(case: str) -> None:
    options, message = OPTION_REFUSALS[case]
    assert any(message in problem for problem in problems(**options)), problems(**options)


def test_every_pipeline_problem_is_reported_at_once() -> None:
    found = problems(
        pipeline_parallel_size=2, pipeline_schedule="GPipe", pipeline_stages_per_rank=2, context_parallel_size=2
    )
    assert len([p for p in found if "pipeline" in p]) == 2, found


def test_defaults_resolve_stages_and_microbatches_per_schedule() -> None:
    one = MixedFSDPConfig(pipeline_parallel_size=4).parallelism
    interleaved = MixedFSDPConfig(pipeline_parallel_size=4, pipeline_schedule="Interleaved1F1B").parallelism
    assert (one.stages_per_rank, one.microbatches) == (1, 4)
    assert (interleaved.stages_per_rank, interleaved.microbatches) == (2, 8)
    assert MixedFSDPConfig().sharding.resolved_reshard_after_forward(1) is True
    assert MixedFSDPConfig().sharding.resolved_reshard_after_forward(2) is False
    assert MixedFSDPConfig(reshard_after_forward=True).sharding.resolved_reshard_after_forward(2) is True


def names(stages: Any) -> List[List[str]]:
    return [list(stage.modules) for stage in stages]


def test_an_hf_decoder_splits_into_balanced_stages_embedding_first_head_last() -> None:
    model = tiny_model("llama", num_hidden_layers=6, tie_word_embeddings=False)
    stages, found = plan_stages(model, 4)
    assert found == []
    assert names(stages) == [
        ["model.embed_tokens", "model.layers.0"],
        ["model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.layers.4"],
        ["model.layers.5", "model.norm", "lm_head"],
    ]
    assert stages_of_rank(1, 2, 2) == [1, 3]


def test_qwen3_splits_and_a_named_split_is_followed() -> None:
    model = tiny_model("qwen3", num_hidden_layers=4, tie_word_embeddings=False)
    stages, found = plan_stages(model, 2, ["model.layers.3"])
    assert found == [] and names(stages)[1] == ["model.layers.3", "model.norm", "lm_head"]


def test_a_block_list_model_splits_at_the_blocks_it_declares() -> None:
    model = TinyLlama(TinyLlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, hidden_dim=64))
    stages, found = plan_stages(model, 2)
    assert found == []
    assert names(stages) == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]


class UsersModel(nn.Module):
    """A model as people write it: embedding, a block list, a head; no pipeline declaration."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)


def test_a_users_model_splits_once_pipeline_split_names_its_blocks() -> None:
    refused, found = plan_stages(UsersModel(), 2)
    assert refused is None and "UsersModel cannot be split into pipeline stages automatically" in found[0]
    stages, found = plan_stages(UsersModel(), 2, ["blocks.2"])
    assert found == [] and names(stages) == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]


SPLIT_REFUSALS = {
    "more_stages_than_blocks": (
        4,
        None,
        "4 pipeline stages (pipeline_parallel_size x pipeline_stages_per_rank) exceed",
    ),
    "wrong_count": (2, ["model.layers.1", "model.layers.2"], "gives 3 stages and pipeline_parallel_size x"),
    "unknown_name": (2, ["model.layers.9"], "pipeline_split names ['model.layers.9'], which are not blocks"),
    "empty_stage": (3, ["model.layers.1", "model.layers.1"], "leaves stage 1 without a block"),
}


@pytest.mark.parametrize("case", list(SPLIT_REFUSALS))
def test_each_split_refusal_names_the_fix(case: str) -> None:
    num_stages, split, message = SPLIT_REFUSALS[case]
    model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=False)
    stages, found = plan_stages(model, num_stages, split)
    assert stages is None and any(message in p for p in found), found


def test_tied_embeddings_are_planned_with_the_tie_named_and_other_sharing_still_refused() -> None:
    from lightning_mixedfsdp.planning.stages import block_layout, tied_to_head

    model = tiny_model("llama", tie_word_embeddings=True)
    stages, found = plan_stages(model, 2)
    assert stages is not None and found == []
    layout = block_layout(model)
    assert layout is not None and tied_to_head(model, layout) == [("lm_head.weight", "model.embed_tokens.weight")]
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    stages, found = plan_stages(model, 2)
    assert stages is None and "uses a Parameter on more than one pipeline stage" in found[0]


def test_the_pipeline_size_must_divide_the_world() -> None:
    found = ParallelDims.resolve_problems(world_size=6, devices_per_node=6, pipeline=4, data_parallel_size=1)
    assert any("pipeline_parallel_size=4 must divide the world size (6)" in p for p in found), found
    dims = ParallelDims.resolve(world_size=8, devices_per_node=8, pipeline=2, replicate=2)
    assert (dims.pipeline, dims.replicate, dims.shard, dims.lightning_data_parallel) == (2, 2, 2, 8)


def test_the_planner_prints_each_stage_with_its_memory(tmp_path: Any, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main
    from tests.hf_models import tiny_config

    tiny_config("llama", num_hidden_layers=4, tie_word_embeddings=False).save_pretrained(tmp_path)
    flags = ["--hf-config", str(tmp_path), "--world-size", "4", "--pipeline", "2", "--seq-len", "64", "--batch", "4"]
    main([*flags, "--pipeline-schedule", "GPipe"])
    gpipe = capsys.readouterr().out
    main(flags)
    one_f_one_b = capsys.readouterr().out
    assert (
        "pipeline: 2 stages on 2 ranks (GPipe, 2 micro-batches of 2 x 64 tokens), each stage FSDP over 2 ranks" in gpipe
    )
    assert "stage 0 (pipeline rank 0): embed_tokens + blocks 0-1," in one_f_one_b
    assert "stage 1 (pipeline rank 1): blocks 2-3 + norm + lm_head," in one_f_one_b
    assert "activations 2 micro-batches in flight" in gpipe.split("stage 1")[1]
    assert "activations 1 micro-batch in flight" in one_f_one_b.split("stage 1")[1]
    assert "stage" in one_f_one_b.split("\n\n")[1].split("\n")[0], "the dtype report's stage column"
    # during a step the stage holds its sharded params and their grads unsharded, in bf16 (the fp32 norms are
    # replicated, whole on every rank already: in the training state)
    from lightning_mixedfsdp.planning.report import format_bytes

    model = tiny_model("llama", num_hidden_layers=4, tie_word_embeddings=False)
    held = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    sharded = sum(p.numel() * 2 for n, p in model.named_parameters() if n.startswith(held) and "norm" not in n)
    first = one_f_one_b.split("stage 1")[0]
    assert f"+ {format_bytes(2 * sharded)} params and grads unsharded during a step" in first
    assert "per rank during a step" in one_f_one_b.split("stage 1")[1]


DECODERS = {
    "llama": {},
    "qwen2": {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1},
    "qwen3": {},
    "olmo2": {},
    "mistral": {"sliding_window": 4},  # a window shorter than the rows
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.5, "logits_scaling": 8.0},
    "gemma3_text": {"sliding_window": 4, "final_logit_softcapping": 30.0},  # scaled embedding, local and global
    "qwen3_moe": {},
    "deepseek_v3": {},
    "jamba": {},  # a Mamba hybrid: attention and Mamba layers, experts every other layer
}
"""Every model type of ``CHECKED_DECODERS``, with the options that make its forward differ from Llama's."""


def test_every_checked_decoder_is_tested_here() -> None:
    from lightning_mixedfsdp.planning.stages import CHECKED_DECODERS

    assert set(DECODERS) == CHECKED_DECODERS


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_two_stages_on_one_rank_compute_what_the_models_own_forward_does(model_type: str) -> None:
    """A decoder of 4 layers cut to two stages both held here (the layers of the other stage passed over, the norm
    skipped before the last stage, hidden states passed on as ``inputs_embeds``), on packed rows: the logits of the
    model's own training forward (``use_cache=False``), to the bit; the setup's probe measures a gap of 0."""
    import torch

    from lightning_mixedfsdp.pipelining.stage_forward import composed_stage_gap, cut_to_stages
    from lightning_mixedfsdp.planning.stages import block_layout

    model = tiny_model(model_type, num_hidden_layers=4, tie_word_embeddings=False, **DECODERS[model_type]).float()
    model.eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)
    with torch.no_grad():
        expected = model(input_ids=tokens, position_ids=positions, use_cache=False).logits
    stages, found = plan_stages(model, 2)
    layout = block_layout(model)
    assert stages is not None and layout is not None, found
    probe = composed_stage_gap(model, layout, stages)
    assert probe.gap == 0.0, probe
    cut_to_stages(model, layout, stages, probe.block_outputs)
    with torch.no_grad():
        hidden = model(tokens, pipeline_stage=0, position_ids=positions)
        got = model(hidden, pipeline_stage=1, position_ids=positions)
    assert torch.equal(got, expected)
    assert [name for name, _ in model.named_parameters()] == [
        name
        for name, _ in tiny_model(
            model_type, num_hidden_layers=4, tie_word_embeddings=False, **DECODERS[model_type]
        ).named_parameters()
    ]


def test_a_decoder_without_the_parts_of_a_causal_lm_is_refused_by_name() -> None:
    """Mamba's causal LM has a ``backbone``, not a ``model`` with ``embed_tokens`` and ``layers``."""
    model = tiny_model("mamba", num_hidden_layers=2)
    stages, found = plan_stages(model, 2)
    assert stages is None and f"{type(model).__name__} cannot be split into pipeline stages automatically" in found[0]


def test_a_router_loss_that_sums_over_every_layer_is_refused_under_stages() -> None:
    model = tiny_model("qwen3_moe", num_hidden_layers=2, tie_word_embeddings=False, output_router_logits=True)
    stages, found = plan_stages(model, 2)
    assert stages is None
    assert found == [
        "Qwen3MoeForCausalLM has output_router_logits=True: its forward sums the routers' load-balancing loss over"
        " every layer, and under pipeline stages each stage holds only its own layers, so the loss would miss the"
        " others' part; set config.output_router_logits=False (and, for a load-balancing term, add one computed in"
        " each stage's layers) or set pipeline_parallel_size=1."
    ]
