"""Context parallel (``parallel.cp``) through the user's loop on Gloo, in real processes: cp = 2
trains a Hugging Face Llama and a Qwen2 (one key/value head) built from configs and the demo
GPT exactly like one process with the same global batch (the logged per-step losses and
gradient norms, with SGD the parameters after the steps, the held-out loss of
``run.evaluate``), and so does cp 2 with data parallel 2 on 4 ranks: ZeRO-3 over
dp_shard x cp, HSDP, DDP. The loop is the plain one: the batches of ``run.steps`` are each
rank's slice of the sequence, and the model numbers it from its global place
(parallel/cp.py). The sequence length, 14, divides by cp but not by 2 x heads. The demo's
targets have ignored (-100) positions, all in the first rank's slice, so its loss is
``sequence_cross_entropy`` (the plain per-rank mean would weight the slices wrongly). What
context parallel cannot run is refused before step 1 (or, for a batch, before its forward),
with the reason, on every rank alike.

The reference runs in the test process, with no process group, on the samples one rank with
the global batch reads (the sampler's order depends only on the seed).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import meshrun
from _dist import run_distributed
from meshrun.demo.model import GPT, GPTConfig

pytestmark = pytest.mark.slow

SEQ = 14  # divides by cp = 2, not by 2 x heads (8 for the Llama, 4 for the GPT)
VOCAB = 64
GLOBAL_BATCH = 4
STEPS = 4
LR = 0.5
TOL = 1e-5
IGNORED = 5  # the demo's first targets are -100: all on cp rank 0's slice of 7
CLIP = 0.2  # the clip uses the norm of the whole gradient: compared too

Params = dict[str, Tensor]


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """64 fixed random token windows: inputs and next-token targets, both [SEQ]."""

    def __init__(self, seq: int = SEQ, ignored: int = 0, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
        self.ignored = ignored

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.data[i, :-1], self.data[i, 1:].clone()
        y[: self.ignored] = -100
        return x, y


def llama(heads: int = 4, kv_heads: int = 2) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32 if heads != 3 else 48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)  # the same weights in every process
        return AutoModelForCausalLM.from_config(config)


def qwen2() -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # one kv head: repeated to 2 before the exchange
        max_position_embeddings=64,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return AutoModelForCausalLM.from_config(config)


def gpt() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=2, d_model=32))


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "qwen2": qwen2, "gpt": gpt}


def step_loss(name: str, model: nn.Module, x: Tensor, y: Tensor, mesh: Any) -> Tensor:
    """The user's loss: the Llama's plain mean (every slice counts the same targets), the
    GPT's over the whole sequences (its ignored targets sit in one slice)."""
    if name != "gpt":
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
    from meshrun.parallel.cp import sequence_cross_entropy

    return sequence_cross_entropy(model(x), y, mesh)


def full_params(model: nn.Module) -> Params:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.named_parameters()
    }


def make_config(run_dir: Path, micro_batch: int, **parallel: int) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(run_dir), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = GLOBAL_BATCH, micro_batch
    cfg.optim.steps, cfg.optim.lr, cfg.optim.grad_clip = STEPS, LR, CLIP
    cfg.metrics.progress = False
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def train(rank: int, world_size: int, cfg: meshrun.Config, name: str) -> dict[str, Any]:
    """The user's loop under meshrun; runs in each spawned rank."""
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(MODELS[name]())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    shapes, values = set(), []
    data = Windows(ignored=IGNORED if name == "gpt" else 0)
    for x, y in run.steps(run.dataloader(data)):
        shapes.add(tuple(x.shape))
        loss = step_loss(name, model, x, y, run.mesh)
        values.append(loss.item())
        run.backward(loss)
        run.optimizer_step(optimizer)
    val = run.dataloader(held_out(name), mode="eval")  # run.evaluate slices its batches too
    evaluated = run.evaluate(model, val, lambda m, b: step_loss(name, m, *b, run.mesh))
    params = full_params(run.unwrap(model))
    result = {"params": params, "shapes": shapes, "values": values, "eval": evaluated}
    run.close()
    return result


def held_out(name: str) -> Windows:
    return Windows(ignored=IGNORED if name == "gpt" else 0, n=8, seed=1)


def reference(name: str) -> tuple[list[float], list[float], Params, float]:
    """One process, the global batch, no process group: per-step losses and gradient norms,
    final parameters, the held-out loss after the steps."""
    data = Windows(ignored=IGNORED if name == "gpt" else 0)
    seed = meshrun.Config().job.seed
    sampler = meshrun.ResumableSampler(
        len(data), rank=0, world_size=1, global_batch=GLOBAL_BATCH, seed=seed
    )
    model = MODELS[name]()
    initial = full_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in itertools.islice(DataLoader(data, GLOBAL_BATCH, sampler=sampler), STEPS):
        loss = step_loss(name, model, x, y, None)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = full_params(model)
    assert max(float((final[k] - initial[k]).abs().max()) for k in final) > 1e-2  # it trains
    x, y = held_out(name).data[:, :-1], held_out(name).data[:, 1:].clone()
    y[:, : held_out(name).ignored] = -100
    with torch.no_grad():
        evaluated = float(step_loss(name, model, x, y, None))
    return losses, norms, final, evaluated


def logged(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return [r[key] for r in steps]


def rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def check(name: str, results: list[dict[str, Any]], run_dir: Path, slice_shape: tuple) -> None:
    ref_losses, ref_norms, ref_params, ref_eval = reference(name)
    loss_diff = rel_diff(logged(run_dir, "loss"), ref_losses)
    norm_diff = rel_diff(logged(run_dir, "grad_norm"), ref_norms)
    eval_diff = rel_diff([r["eval"] for r in results], [ref_eval] * len(results))
    param_diff = max(
        float((r["params"][k] - ref_params[k]).abs().max()) for r in results for k in ref_params
    )
    print(
        f"{name}: max rel diff loss {loss_diff:.2g}, grad norm {norm_diff:.2g} (norms "
        f"{[round(n, 3) for n in ref_norms]}, clip {CLIP}), held-out loss {eval_diff:.2g}; "
        f"max |param diff| {param_diff:.2g}"
    )
    assert max(loss_diff, norm_diff, eval_diff) <= TOL, (loss_diff, norm_diff, eval_diff)
    assert param_diff <= TOL
    for r in results:
        assert r["shapes"] == {slice_shape}  # each rank saw its slice, not the whole sequence


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("llama", {}),
        # heavy: qwen2 and llama_ac; llama and gpt stay (a transformers model, a hand-written one)
        pytest.param("qwen2", {}, marks=pytest.mark.heavy),
        ("gpt", {}),
        pytest.param("llama", {"activation_checkpoint": 1}, marks=pytest.mark.heavy),
    ],
    ids=["llama", "qwen2", "gpt", "llama_ac"],
)
def test_cp2_trains_like_one_process(name: str, extra: dict[str, int], tmp_path: Path) -> None:
    # DDP (zero 0) over dp x cp = 1 x 2; micro-batch 2, accumulation 2. With activation
    # checkpointing the backward recomputes each block, its all-to-alls included.
    cfg = make_config(tmp_path / "run", micro_batch=2, cp=2, **extra)
    results = run_distributed(train, 2, cfg, name, timeout=150)
    check(name, results, tmp_path / "run", (2, SEQ // 2))
    if name == "gpt":  # sequence_cross_entropy's value is the whole sequences' on both ranks
        assert results[0]["values"] == pytest.approx(results[1]["values"], rel=1e-6)


LAYOUTS_ON_4 = {
    "dp_shard2_zero3": {"dp_shard": 2, "zero": 3},  # FSDP2 over dp_shard_cp (4 ranks)
    "hsdp_dp_replicate2_zero3": {"dp_replicate": 2, "dp_shard": 1, "zero": 3},
    "dp_shard2_ddp": {"dp_shard": 2, "zero": 0},  # DDP over dp_cp (4 ranks)
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout",
    [
        # heavy (CI's time): test_cp2_trains_like_one_process shows cp with DDP; FSDP2 over
        # other meshes runs in CI in tests/dist/test_layouts.py
        pytest.param("dp_shard2_zero3", marks=pytest.mark.heavy),
        # heavy: test_cp2_trains_like_one_process shows DDP with cp (over dp x cp = 1 x 2)
        pytest.param("dp_shard2_ddp", marks=pytest.mark.heavy),
        # heavy: dp_shard2_zero3 shows FSDP2 over dp x cp, tests/dist/test_layouts.py's
        # "HSDP 2x2" the replicate dimension
        pytest.param("hsdp_dp_replicate2_zero3", marks=pytest.mark.heavy),
    ],
)
def test_cp2_with_data_parallel_2_trains_like_one_process(layout: str, tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "run", micro_batch=2, cp=2, **LAYOUTS_ON_4[layout])
    results = run_distributed(train, 4, cfg, "llama", timeout=210)
    check("llama", results, tmp_path / "run", (2, SEQ // 2))


SAVE_AT, RESUME_STEPS = 3, 6


def train_resumable(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """The user's loop with checkpoints (AdamW: its state is resharded too); the losses are
    in the run's metrics."""
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    loader = run.dataloader(Windows())
    start = run.resume(model, optimizer, loader)
    for x, y in run.steps(loader):
        run.backward(step_loss("llama", model, x, y, run.mesh))
        run.optimizer_step(optimizer)
    run.close()
    return {"start": start}


def resume_config(
    run_dir: Path, ckpt: Path, resume: str, world: int, **parallel: int
) -> meshrun.Config:
    dp = world // parallel.get("cp", 1)
    cfg = make_config(run_dir, micro_batch=GLOBAL_BATCH // dp, **parallel)
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = RESUME_STEPS, 0, 1e-2
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(ckpt), resume
    cfg.checkpoint.interval = SAVE_AT
    return cfg


def logged_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r and "event" not in r}


# (ranks, layout) saved -> (ranks, layout) resumed
RESUMES = {
    "cp2_to_cp1_dp2": ((2, {"cp": 2}), (2, {"cp": 1})),
    "cp2_dp2_zero3_to_cp1_dp2_zero3": (
        (4, {"cp": 2, "dp_shard": 2, "zero": 3}),
        (2, {"cp": 1, "zero": 3}),
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    [
        # heavy (CI's time, 4 ranks twice): a checkpoint resumed on another layout runs in CI in
        # tests/dist/test_checkpoint.py (other world sizes) and test_ep_checkpoint.py (other ep)
        pytest.param("cp2_to_cp1_dp2", marks=pytest.mark.heavy),
        # heavy: cp2_to_cp1_dp2 shows a cp checkpoint resumed at another cp size
        pytest.param("cp2_dp2_zero3_to_cp1_dp2_zero3", marks=pytest.mark.heavy),
    ],
)
def test_cp_checkpoint_resumes_at_another_cp(case: str, tmp_path: Path) -> None:
    """Saved at cp = 2 (step 3 of 6), resumed at cp = 1 with dp 2 (each rank whole sequences,
    the same global batch of 4): the data position is kept and steps 4-6 lose what the
    uninterrupted cp = 2 run lost, within 1e-6. ZeRO-3's shards are resharded by DCP."""
    from meshrun.checkpoint import on_disk

    (world, saved), (world2, resumed_at) = RESUMES[case]
    ckpt = tmp_path / "ckpt"
    cfg = resume_config(tmp_path / "ref", ckpt, "never", world, **saved)
    run_distributed(train_resumable, world, cfg, timeout=200)
    ref = logged_losses(tmp_path / "ref")
    assert sorted(ref) == list(range(1, RESUME_STEPS + 1))
    at = str(on_disk.step_dir(ckpt, SAVE_AT))
    cfg = resume_config(tmp_path / "cp1", tmp_path / "ckpt1", at, world2, **resumed_at)
    got = run_distributed(train_resumable, world2, cfg, timeout=200)
    assert {g["start"] for g in got} == {SAVE_AT}
    resumed = logged_losses(tmp_path / "cp1")
    assert sorted(resumed) == list(range(SAVE_AT + 1, RESUME_STEPS + 1))
    diff = max(abs(resumed[s] - ref[s]) / abs(ref[s]) for s in resumed)
    print(f"{case} at step {SAVE_AT}: max rel loss diff {diff:.2e} ({resumed})")
    assert diff <= 1e-6


class NoPositions(nn.Module):
    """Attention through the ``sdpa`` seam, but a forward that cannot take global positions."""

    n_head = 2

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.sdpa = F.scaled_dot_product_attention

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx).view(*idx.shape, 2, 4).transpose(1, 2)
        return self.sdpa(h, h, h, is_causal=True)


def hf_model(kind: str) -> nn.Module:
    import transformers as tf

    small = {"vocab_size": VOCAB, "hidden_size": 32}
    if kind == "bloom":  # ALiBi, its own attention code: no AttentionInterface
        return tf.BloomForCausalLM(tf.BloomConfig(**small, n_layer=1, n_head=2))
    config = tf.MistralConfig(
        **small,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    return tf.MistralForCausalLM(config)


def refusals(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, str]:
    """Each refusal's message, on every rank (all raise together: no rank is left waiting)."""
    from meshrun.config import ConfigError

    run = meshrun.init(cfg, argv=[])
    out: dict[str, str] = {}

    def refused(name: str, fn: Callable[[], object]) -> None:
        with pytest.raises(ConfigError) as info:
            fn()
        out[name] = str(info.value)

    refused("heads", lambda: run.parallelize(llama(heads=3, kv_heads=3)))
    refused("bloom", lambda: run.parallelize(hf_model("bloom")))
    refused("sliding", lambda: run.parallelize(hf_model("mistral")))
    refused("plain", lambda: run.parallelize(nn.Sequential(nn.Embedding(VOCAB, 8))))
    refused("positions", lambda: run.parallelize(NoPositions()))
    model = run.unwrap(run.parallelize(llama()))
    x = torch.randint(0, VOCAB, (2, SEQ // 2))
    mask = torch.ones_like(x)
    mask[1, -1] = rank  # padding on rank 0's slice only
    refused("padding", lambda: model(x, attention_mask=mask))
    refused("labels", lambda: model(x, labels=x))
    refused("length", lambda: next(iter(run.steps(run.dataloader(Windows(seq=SEQ + 1))))))
    run.close()
    return out


@pytest.mark.timeout(120)
def test_what_cp_cannot_run_is_refused_with_the_reason(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "run", micro_batch=2, cp=2)
    results = run_distributed(refusals, 2, cfg, timeout=100)
    assert results[0] == results[1]
    got = results[0]
    print(json.dumps(got, indent=1))
    assert "each cp rank whole attention heads, but the model has 3 heads" in got["heads"]
    assert "BloomForCausalLM's attention does not go through" in got["bloom"]
    assert "full causal attention only; MistralForCausalLM has sliding-window" in got["sliding"]
    assert "is neither a transformers model nor has modules" in got["plain"]
    assert "NoPositions.forward takes no position_ids" in got["positions"]
    assert "without a mask (no padding, no packing)" in got["padding"]
    assert "labels= makes the model shift the targets inside each rank's slice" in got["labels"]
    assert "sequence length 15 does not divide by parallel.cp = 2" in got["length"]
