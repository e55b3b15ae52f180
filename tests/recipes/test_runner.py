"""The runner as a user runs it (``python -m lightning_mixedfsdp.train`` in a subprocess, 2 CPU processes) on the main
job at tiny sizes (the launches of ``main_job.py``: one uninterrupted run, runs stopped by SIGTERM to their process
group and resumed, the finished run extended): what each left behind (losses, checkpoints, export, plot, metrics,
console log). Refusals that happen before any process starts run in this process, except one run of the whole command
(nothing may start for them)."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.run.plot import read_metrics
from tests.recipes.main_job import (
    EVERY,
    EXTENDED,
    KEEP,
    OVERRIDES,
    PROBE,
    RECIPE,
    ROOT,
    STEPS,
    TINY,
    VALIDATE_EVERY,
    checkpoint_step,
    command,
    losses,
)  # fmt: skip

pytestmark = pytest.mark.timeout(1800)
"""A hang bound, not a speed bound: the first test that asks for ``runs`` waits for its six launches (each bounded
by its own subprocess timeout), which on a loaded machine can pass pytest's default of 300 s."""


@pytest.fixture(scope="module")
def runs(main_job: Dict[str, Any]) -> Dict[str, Any]:
    return main_job


def test_the_main_job_trains_reports_perplexity_and_saves_checkpoints_bounded(runs: Dict[str, Any]) -> None:
    out, whole = runs["whole_out"], runs["whole"]
    assert "mixed_fsdp2 dtype plan" in out and "replicated" in out
    before, after = map(float, re.search(r"held-out perplexity: ([\d.]+) untrained -> ([\d.]+)", out).groups())
    assert after < before / 4, out[-2000:]
    assert f"after {STEPS} steps" in out
    assert (whole / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    assert runs["whole_step"] == STEPS
    # every EVERY steps a numbered checkpoint; the newest KEEP kept, the final state only in last.ckpt
    assert runs["numbered_after_whole"] == sorted(f"step={s}.ckpt" for s in (STEPS - 2 * EVERY, STEPS - EVERY))
    assert "Traceback" not in out
    assert "LeafSpec" not in out  # Lightning's deprecation, silenced at its call site


def test_sigterm_to_the_process_group_under_timeout_saves_at_a_step_boundary_and_exits_cleanly(
    runs: Dict[str, Any],
) -> None:
    interrupted, step = runs["interrupted"], runs["stopped_step"]
    out = interrupted["out"]
    assert interrupted["returncode"] == 128 + signal.SIGTERM, out[-3000:]
    assert EVERY <= step < STEPS, out[-3000:]  # stopped mid-run, after the checkpoint it waited for
    assert f"stopped at step {step} of {STEPS}" in out and "--resume last" in out
    assert "SIGTERM: stopping at the next step boundary" in out
    assert "again: aborting" not in out  # timeout's copies of the request are the same request
    assert "Traceback" not in out
    assert not runs["stopped_exported"]  # an unfinished run exports nothing


def test_sigterm_through_torchrun_saves_and_resumes_to_the_uninterrupted_losses(runs: Dict[str, Any]) -> None:
    """torchrun under timeout: each worker gets the request twice (torchrun forwards both copies it received).
    torchrun itself exits 1 with its own traceback (its SignalException); the workers save and end cleanly."""
    out, step = runs["torchrun_interrupted"]["out"], runs["torchrun_step"]
    assert EVERY <= step < STEPS, out[-3000:]
    assert "SIGTERM: stopping at the next step boundary" in out and f"stopped at step {step} of {STEPS}" in out
    assert "again: aborting" not in out, out[-3000:]
    assert losses(runs["torchrun"]) == runs["whole_losses"]  # bit for bit, before the stop and after the resume


def test_the_resumed_run_repeats_the_uninterrupted_losses_exactly(runs: Dict[str, Any]) -> None:
    whole, stopped = runs["whole_losses"], losses(runs["stopped"])
    assert len(whole) == STEPS and sorted(stopped) == sorted(whole)
    assert stopped == whole  # bit for bit, the steps before the stop and after the resume
    assert read_metrics(runs["stopped"] / "logs")["val_ppl"] == runs["whole_metrics"]["val_ppl"]
    assert f"resuming from {runs['stopped'] / 'checkpoints' / 'last.ckpt'}" in runs["resumed_out"]
    # the held-out perplexity before training comes from the first launch's log
    assert re.search(rf"held-out perplexity: [\d.]+ untrained -> [\d.]+ after {STEPS} steps", runs["resumed_out"])


def test_extending_a_finished_run_trains_on_the_schedule_replanned_to_the_new_end(runs: Dict[str, Any]) -> None:
    from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine

    whole = runs["whole"]
    metrics = read_metrics(whole / "logs")
    assert sorted(metrics["train_loss"]) == list(range(EXTENDED))
    assert {s: metrics["train_loss"][s] for s in range(STEPS)} == runs["whole_losses"]  # the first run's, kept
    assert checkpoint_step(whole / "checkpoints" / "last.ckpt") == EXTENDED
    assert f"after {EXTENDED} steps" in runs["extended_out"]
    assert EXTENDED - 1 in metrics["val_ppl"]  # evaluated at the new end (Lightning logs the 0-based step)
    for step in range(STEPS, EXTENDED):  # the rate each update used: 0.01 x the cosine planned to EXTENDED
        assert metrics["lr"][step] == pytest.approx(0.01 * warmup_cosine(step, 20, EXTENDED), rel=1e-6)
    assert metrics["lr"][STEPS - 1] == pytest.approx(0.01 * warmup_cosine(STEPS - 1, 20, STEPS), rel=1e-6)
    assert len(list((whole / "checkpoints").glob("step=*.ckpt"))) == KEEP


def test_resuming_a_finished_run_says_so_and_exits_nonzero(runs: Dict[str, Any], capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    with pytest.raises(SystemExit) as exit_:
        main([*TINY, f"output.dir={runs['stopped']}", "--resume", "last"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert f"is at step {STEPS} and trainer.max_steps={STEPS}: the run is done" in error
    assert f"trainer.max_steps=N with N > {STEPS}" in error


def test_metrics_plot_and_console_log_are_in_the_run_folder(runs: Dict[str, Any]) -> None:
    whole, out = runs["whole"], runs["whole_out"]
    metrics = runs["whole_metrics"]
    assert set(metrics) >= {"train_loss", "lr", "val_ppl", "untrained_ppl"}
    assert sorted(metrics["val_ppl"]) == [VALIDATE_EVERY - 1, STEPS - 1]
    untrained = metrics["untrained_ppl"][0]
    assert f"held-out perplexity: {untrained:.2f} untrained" in out
    plot = whole / "metrics.png"
    assert f"plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    console = (whole / "console.log").read_text()
    assert console.count("===== ") == 2  # the run and its extension, each headed by its command
    for line in ("mixed_fsdp2 dtype plan", f"held-out perplexity: {untrained:.2f} untrained", f"plot: {plot}"):
        assert line in console


def test_the_export_loads_with_from_pretrained_and_equals_the_trained_model(runs: Dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_mixedfsdp import load_weights
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
    from lightning_mixedfsdp.recipes.run.loader import load_recipe

    export, trained = runs["export"], runs["trained"]
    saved = load_file(str(export / "model.safetensors"))
    assert saved["layers.1.attention.A_log"].dtype == saved["layers.0.attention_norm.weight"].dtype == torch.float32
    assert saved["output.weight"].dtype == torch.bfloat16
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    # a plain load: bf16 bulk from the config, the export's fp32 tensors kept fp32, every value as trained
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    state = model.state_dict()
    assert set(state) == set(trained)
    for name, value in trained.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    full = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).state_dict()
    assert all(torch.equal(full[n], v.float()) for n, v in trained.items())
    # the trained model: its checkpoint in the reference model, by load_weights (bf16, fp32 norms, boundaries)
    recipe = load_recipe(RECIPE, OVERRIDES, launching=False)
    reference = load_weights(TinyLlama(recipe.model), trained, torch.bfloat16, recipe.mixed_fsdp_config())
    tokens = torch.tensor([list(PROBE)])
    with torch.no_grad():
        expected, got = reference(tokens), model(input_ids=tokens).logits
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()
    greedy = tokens
    with torch.no_grad():  # generate() recomputes the prefix (no KV cache): the same tokens as greedy by hand
        for _ in range(3):
            greedy = torch.cat([greedy, model(input_ids=greedy).logits[:, -1:].argmax(-1)], dim=1)
        out = model.generate(
            tokens, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        # each step's logits are the trained model's on the whole sequence so far, to the bit (a cache this model
        # never fills would feed it the newest token alone, and the tokens would agree only by luck)
        for step, logits in enumerate(out.logits):
            assert torch.equal(logits, reference(out.sequences[:, : tokens.shape[1] + step])[:, -1].float()), step
    assert torch.equal(out.sequences, greedy)


def test_the_export_has_a_byte_tokenizer_that_round_trips_text(runs: Dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(runs["export"], trust_remote_code=True)
    text = PROBE.decode() + "naïve café — ✓ 🙂\n\tend"
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer) == 256
    assert ids == list(text.encode("utf-8"))  # the ids the model was trained on: one per byte
    assert tokenizer.decode(ids) == text


def test_export_files_are_written_with_the_umask_like_any_file(runs: Dict[str, Any]) -> None:
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in runs["export"].iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "hf_tinyllama.py", "tiny_llama.py"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~mask}, modes


def _fake_checkpoint(path: Path, step: int, saved_s: Optional[int] = None) -> Path:
    """A single-file checkpoint as far as the run folder reads one (its step), written at ``saved_s`` (seconds
    since the epoch) when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "epoch": 0}, path)
    if saved_s is not None:
        os.utime(path, ns=(saved_s * 10**9, saved_s * 10**9))
    return path


def test_resume_without_a_checkpoint_is_one_line_naming_the_folder_and_the_fix(tmp_path: Path, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    with pytest.raises(SystemExit) as exit_:
        main([*TINY, f"output.dir={tmp_path / 'run'}", "--resume", "last"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"error: --resume last: {tmp_path / 'run' / 'checkpoints'} holds no checkpoint (no run saved one there);"
        " start without --resume, or set output.dir to the folder of the run to continue"
    )
    assert not (tmp_path / "run").exists()  # nothing written for a refused command


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_with_the_fix(tmp_path: Path, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    _fake_checkpoint(tmp_path / "checkpoints" / "step=8.ckpt", 8)
    with pytest.raises(SystemExit):
        main([*TINY, f"output.dir={tmp_path}"])
    error = capsys.readouterr().err
    assert "holds the checkpoints of an earlier run (newest: step=8.ckpt, step 8); continue it with --resume" in error


def test_the_newest_checkpoint_is_the_last_saved_and_slurm_requeues_resume_by_themselves(tmp_path: Path) -> None:
    from lightning_mixedfsdp.recipes.run.run_folder import RunFolder, RunFolderError, resume_from

    folder = RunFolder(tmp_path)
    _fake_checkpoint(folder.numbered(30), 30, saved_s=1_000)
    _fake_checkpoint(folder.last, 12, saved_s=1_001)  # a later branch, resumed from an earlier checkpoint
    hpc = _fake_checkpoint(tmp_path / "hpc_ckpt_1.ckpt", 14, saved_s=1_002)  # Lightning's SLURM requeue save
    assert resume_from(folder, "last", 40, under_slurm=False) == hpc
    assert resume_from(folder, None, 40, under_slurm=True) == hpc  # a requeued job reruns its command unchanged
    with pytest.raises(RunFolderError, match="holds the checkpoints of an earlier run"):
        resume_from(folder, None, 40, under_slurm=False)
    assert resume_from(folder, str(folder.numbered(30)), 40, under_slurm=False) == folder.numbered(30)


def test_resume_takes_overrides_before_or_after_it(tmp_path: Path, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    _fake_checkpoint(tmp_path / "checkpoints" / "last.ckpt", STEPS)
    for argv in (
        [*TINY, f"output.dir={tmp_path}", "--resume", "last", f"trainer.max_steps={STEPS}"],
        [*TINY, f"output.dir={tmp_path}", "--resume", f"trainer.max_steps={STEPS}"],  # --resume's value is optional
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert f"is at step {STEPS} and trainer.max_steps={STEPS}: the run is done" in capsys.readouterr().err


def test_what_the_strategy_and_the_pipeline_would_refuse_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    """The main job with a context-parallel size the 2 processes and the mixer layer cannot take: the mesh sizes, the
    mixer and the sequence length, each a line naming the recipe key that fixes it, and no process started."""
    output = tmp_path / "run"
    completed = subprocess.run(
        command("--config", RECIPE, "strategy.parallelism.context_parallel_size=3", f"output.dir={output}"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = completed.stdout + completed.stderr
    assert completed.returncode == 2, out[-5000:]
    assert "Traceback" not in out and "Initializing distributed" not in out and "dtype plan" not in out
    problems = [line for line in completed.stderr.splitlines() if line.startswith("  - ")]
    assert completed.stderr.startswith("Recipe has 4 problems:\n") and len(problems) == 4, out[-5000:]
    assert "data.seq_len=128 must divide into 2 x strategy.parallelism.context_parallel_size = 6 chunks" in problems[0]
    assert "multiplied should equal the world size (trainer.devices=2 x trainer.num_nodes=1 = 2)" in problems[1]
    assert "strategy.parallelism.context_parallel_size=3 must divide the world size" in problems[2]
    assert "set model.mixer_layers=[]" in problems[3]
    assert not output.exists()  # no run folder, no console log: nothing started


def test_the_dry_run_refuses_what_a_launch_would(tmp_path: Path, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    with pytest.raises(SystemExit) as exit_:
        main([*TINY, f"output.dir={tmp_path}", "strategy.parallelism.context_parallel_size=2", "--dry-run"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("Recipe has 1 problem: model.mixer_layers=[1]: ") and "dtype plan" not in (
        captured.out
    )


BLOCKED = """
import sys
import threading
from datetime import timedelta
import torch.distributed as dist
from lightning_mixedfsdp.recipes.run.stopping import StopRequest
window, port = float(sys.argv[1]), int(sys.argv[2])
stop = StopRequest(repeat_window_s=window)
stop.install()
# a rendezvous whose rank 1 does not come: the main thread waits in C++, where no Python signal handler runs
dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(hours=1))
print("released", flush=True)
stop.restore()  # the watcher reads what is left on its pipe, then ends
for thread in threading.enumerate():
    if thread.name == "stop-request":
        thread.join()
print("stop request:", stop.signal, flush=True)
"""


@contextlib.contextmanager
def blocked_in_a_rendezvous(window: float) -> Iterator[Tuple[subprocess.Popen, int]]:
    """A process whose stop request has the repeat window ``window``, its main thread blocked in C++ (the
    rendezvous's store listens on the port it waits on) until the test comes as rank 1; killed if still there at
    the end."""
    from lightning_mixedfsdp.testing import free_port

    port = free_port()
    with subprocess.Popen(
        [sys.executable, "-c", BLOCKED, str(window), str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            wait_for(lambda: listening(port), f"a listener on port {port}", process)
            yield process, port
        finally:
            if process.poll() is None:
                process.kill()


def listening(port: int) -> bool:
    """Whether a socket listens on ``port``, from the kernel's tables (a probing connection could count as a peer)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rpartition(":")[2], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


def deliver(process: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` and wait until the kernel has handed it to a thread of ``process``: the next one sent is a
    delivery of its own, not merged into this one while pending."""

    def delivered() -> bool:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{process.pid}/status").read_text().splitlines())
        return not any(int(status[mask], 16) >> (signum - 1) & 1 for mask in ("SigPnd", "ShdPnd"))

    process.send_signal(signum)
    wait_for(delivered, f"the delivery of {signal.Signals(signum).name}", process)


def wait_for(condition: Callable[[], bool], what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240  # bounds a hang only: the loop ends when the condition holds
    while not condition():
        assert process.poll() is None, f"the process ended waiting for {what}: {process.communicate()[0]}"
        assert time.monotonic() < deadline, f"no {what} within 240 s"
        time.sleep(0.01)


def test_stop_signals_within_the_repeat_window_are_one_request_even_to_a_rank_blocked_in_a_collective() -> None:
    """A launcher's copies and a later Ctrl-C, all within the (unbounded) window: one request, which the main
    thread takes up once it returns from C++; the watcher judged every one of them before the process ends."""
    from torch.distributed import TCPStore

    with blocked_in_a_rendezvous(math.inf) as (process, port):
        for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGINT):
            deliver(process, signum)
        # rank 1 comes, from a thread: a process that aborted fails the test now, not after the client's retries
        rank_1 = {"world_size": 2, "is_master": False, "timeout": timedelta(seconds=240)}
        threading.Thread(target=TCPStore, args=("127.0.0.1", port), kwargs=rank_1, daemon=True).start()
        out, _ = process.communicate(timeout=240)
    assert process.returncode == 0, out
    assert "again: aborting" not in out
    assert out.count("stopping at the next step boundary") == 1, out
    assert re.search(r"stop request: (2|15)\n", out), out


def test_a_stop_signal_after_the_repeat_window_ends_a_rank_blocked_in_a_collective_at_once() -> None:
    """With a window of 0 any second stop signal is a new request: the watcher thread ends the process while its
    main thread stays blocked in C++ (its handler never runs, the rendezvous never completes)."""
    with blocked_in_a_rendezvous(0.0) as (process, _):
        deliver(process, signal.SIGTERM)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=240)  # bounds a hang only: nothing but the abort ends the process
    assert process.returncode == 128 + signal.SIGTERM, out
    assert out.count("again: aborting") == 1 and "SIGTERM again: aborting" in out
    assert "stopping at the next step boundary" not in out and "released" not in out


def test_the_byte_tokenizer_is_written_without_transformers_and_loads_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default install has neither transformers nor tokenizers: the export's tokenizer is written without them
    (both made unimportable before the call, every module of theirs unloaded)."""
    from lightning_mixedfsdp.recipes.run.hf_export import write_byte_tokenizer

    for name in [n for n in sys.modules if n.split(".")[0] in ("transformers", "tokenizers")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    write_byte_tokenizer(tmp_path)
    monkeypatch.undo()  # every module back as it was
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = PROBE.decode() + "naïve café — ✓ 🙂\n\tend"
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer) == 256 and ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_the_runner_without_the_recipes_extra_says_the_install_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, f"output.dir={tmp_path}"])
    assert exit_info.value.code == 2
    assert "needs matplotlib, which the `recipes` extra installs: pip install 'lightning-mixedfsdp[recipes]'" in (
        capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_dry_run_with_lora_without_peft_says_the_install_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    config = ROOT / "benchmarks" / "configs" / "llama3_8b.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--dry-run", "peft.enabled=true", f"model.hf_config={config}", "trainer.devices=8"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: peft.enabled=true needs peft, which is not installed: pip install 'lightning-mixedfsdp[peft]'  (or:"
        " pip install peft)\n"
    )


def test_the_last_line_says_before_for_pretrained_weights_and_untrained_from_scratch() -> None:
    """The lines README quotes are the runner's own, for README's numbers."""
    import math
    import re

    from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM
    from lightning_mixedfsdp.recipes.objectives.sft import ChatLM

    readme = (ROOT / "README.md").read_text()
    number = r"([0-9.]+)"
    first, last, steps = re.search(rf"trained tokens: {number} before -> {number} after (\d+) steps", readme).groups()
    sft = ChatLM.summary(math.exp(float(first)), math.exp(float(last)), int(steps), pretrained=True)
    assert sft.startswith(f"held-out loss on the trained tokens: {first} before -> {last} after {steps} steps")
    start, end, steps = re.search(
        rf"held-out perplexity: {number} untrained -> {number} after (\d+) steps", readme
    ).groups()
    scratch = CausalLM.summary(float(start), float(end), int(steps), pretrained=False)
    assert scratch == f"held-out perplexity: {start} untrained -> {end} after {steps} steps"
    assert CausalLM.summary(21.69, 3.91, 300, pretrained=True).startswith("held-out perplexity: 21.69 before")
    assert sft in readme and scratch in readme  # the lines README quotes, as the runner prints them
