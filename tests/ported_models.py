"""Models of the three ported scripts' shapes and one training run through ``meshrun.init``,
for comparing a layout's logged losses and gradient norms with one process.

The models are written here (nothing downloaded), in the shapes of the public scripts:

- :class:`LSTMLM`: pytorch/examples ``word_language_model``'s RNN model: an embedding, a
  2-layer ``nn.LSTM``, a decoder tied to the embedding;
- :class:`EncoderLM`: its Transformer model's parts (``nn.TransformerEncoder`` of
  ``nn.TransformerEncoderLayer``, torch's own attention), causal, with a tied decoder and a
  vocabulary of 4,096 x 256 (a 1M-element gradient: enough for torch's fp32 norm to lose
  2e-5, measured);
- :func:`qwen2_257`: a Hugging Face Qwen2 with an odd vocabulary (257), built from its config.

:func:`train` runs one of them under a ``ParallelConfig`` as a user script does
(``run.parallelize`` or ``run.pipeline``, ``run.optimizer``, ``run.steps``, ``run.backward``,
``run.optimizer_step`` with ``optim.grad_clip``) and returns the losses and gradient norms that
meshrun logged (metrics.jsonl), or the refusal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SEQ = 32
GLOBAL_BATCH = 8
LR = 1.0  # SGD without momentum, as word_language_model (its default lr is 20)
# word_language_model's --clip is 0.25; the LSTM's norms here are ~0.08: each model's clip is
# below every step's norm, so the coefficient is used on every step.
CLIP = {"lstm": 0.05, "transformer": 0.25, "qwen2-257": 0.25}


class LSTMLM(nn.Module):
    """word_language_model's ``RNNModel('LSTM', ..., tie_weights=True)``, without dropout."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.encoder.weight  # tied, as the script's --tied
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)  # the script's init_weights
        nn.init.zeros_(self.decoder.bias)

    def forward(self, idx: Tensor) -> Tensor:
        out, _ = self.rnn(self.encoder(idx))
        return self.decoder(out)


class EncoderLM(nn.Module):
    """A causal LM on torch's ``nn.TransformerEncoder`` with a tied decoder."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.input_emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.input_emb.weight
        nn.init.uniform_(self.input_emb.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.encoder(self.input_emb(idx) + self.pos[:t], mask=mask, is_causal=True)
        return self.decoder(x)


def qwen2_257() -> nn.Module:
    """A 2-layer Qwen2 (GQA, q/k/v bias) with a 257-token vocabulary, fp32, eager attention."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_sliding_window=False,
        attn_implementation="eager",
        dtype=torch.float32,
    )
    return Qwen2ForCausalLM(cfg)


VOCAB = {"lstm": 4096, "transformer": 4096, "qwen2-257": 257}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "lstm":
        return LSTMLM()
    if name == "transformer":
        return EncoderLM()
    return qwen2_257()


def logits_of(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    logits = logits_of(logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Windows(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Token windows over the whole vocabulary (every row of the tied gradient is touched)."""

    def __init__(self, vocab: int, n: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input": self.tokens[i, :-1], "target": self.tokens[i, 1:]}


def make_config(run_dir: str, model: str, parallel: dict[str, Any], world: int, steps: int) -> Any:
    import meshrun

    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 120.0
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    dp = world // (tp * pp)
    cfg.data.global_batch, cfg.data.micro_batch = GLOBAL_BATCH, GLOBAL_BATCH // dp
    cfg.optim.steps, cfg.optim.lr, cfg.optim.grad_clip = steps, LR, CLIP[model]
    cfg.optim.warmup_steps, cfg.optim.decay = 0, "constant"
    cfg.metrics.progress = False
    cfg.checkpoint.interval = 0
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def train(
    rank: int, world_size: int, model: str, cfg: Any, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One run of ``model`` under ``cfg`` (a spawned rank: see tests/_dist.py); rank 0 returns
    the logged losses and gradient norms, or ``{"refused": reason}`` (every rank alike).
    ``options``: keywords for ``run.parallelize`` / ``run.pipeline`` (``tp_plan``, ...)."""
    import meshrun

    run = meshrun.init(cfg, argv=[])
    try:
        if cfg.parallel.pp > 1:
            pipe = run.pipeline(build(model), lm_loss, **(options or {}))
            opt = run.optimizer(pipe, torch.optim.SGD, lr=LR)
        else:
            net = run.parallelize(build(model), **(options or {}))
            opt = run.optimizer(net, torch.optim.SGD, lr=LR)
    except meshrun.ConfigError as e:
        run.close()
        return {"refused": str(e)}
    norms = []
    for batch in run.steps(run.dataloader(Windows(VOCAB[model]))):
        if cfg.parallel.pp > 1:
            run.pipeline_step(pipe, batch["input"], batch["target"])
        else:
            with run.loss_parallel():
                loss = lm_loss(net(batch["input"]), batch["target"])
            run.backward(loss)
        if run.optimizer_step(opt):
            norms.append(run.grad_norm)
    run.close()
    rows = [json.loads(x) for x in Path(cfg.job.run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    return {
        "losses": [r["loss"] for r in steps],
        "grad_norms": [r.get("grad_norm", math.nan) for r in steps],
        "norms": norms,
    }


def max_rel(got: list[float], ref: list[float]) -> float:
    """The largest per-step relative difference (inf when a value is not finite)."""
    assert len(got) == len(ref), (len(got), len(ref))
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / abs(b))
    return worst
