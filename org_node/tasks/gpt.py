"""A small character-level GPT on the text corpus shipped with fedweave.

Decoder-only transformer (Radford et al., 2018/2019; in the spirit of nanoGPT): token and
position embeddings, pre-norm blocks of causal self-attention and an MLP, a final norm
and a linear head. Its blocks support

- tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3): query/key/value and
  the MLP's first layer are split by columns, the attention and MLP output projections by
  rows, so each block costs one all-reduce forward and one backward. Attention reshapes
  by ``-1`` heads, so a rank computes the heads its column shard holds;
- pipeline parallelism: :meth:`CharGPT.pipeline_stage` keeps the embeddings on the first
  stage, the final norm and head on the last, and an even share of blocks on each; the
  blocks live in a ``ModuleDict`` keyed by their index, so names stay those of the full
  model and the stages' state dicts merge back into it.

The vocabulary is fixed (newline and printable ASCII, 96 symbols), so the model's shapes
do not depend on the corpus; other characters map to ``?``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from org_node.tasks import Task, TaskData

__all__ = [
    "VOCAB",
    "WIDE",
    "CharGPT",
    "GPTConfig",
    "build_data",
    "decode",
    "encode",
    "task",
    "task_large",
    "task_wide",
]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def encode(text: str) -> list[int]:
    """Characters to token ids; characters outside the vocabulary become ``?``."""
    unknown = _INDEX["?"]
    return [_INDEX.get(ch, unknown) for ch in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model.

    n_layers: number of transformer blocks (also the most pipeline stages).
    d_model: width of the residual stream.
    n_heads: attention heads; must divide ``d_model``, and the TP degree must divide it.
    block_size: context length in characters.
    """

    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    block_size: int = 32

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds only its share of the heads.
        q, k, v = (
            lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class CharGPT(nn.Module):
    """The full model, or one pipeline stage of it (absent parts are None)."""

    tok_emb: nn.Embedding | None
    pos_emb: nn.Embedding | None
    ln_f: nn.LayerNorm | None
    head: nn.Linear | None

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(len(VOCAB), cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, len(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a middle stage maps hidden to hidden."""
        h = x
        if self.tok_emb is not None and self.pos_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.head is not None:
            h = self.head(h)
        return h

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Megatron-style column/row splits of every block present."""
        plan: dict[str, ParallelStyle] = {}
        for name in self.blocks:
            prefix = f"blocks.{name}"
            # q, k and v read one replicated DTensor: their input gradients (partial sums)
            # add up first, so the backward needs one all-reduce for the three, not three.
            plan[f"{prefix}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            )
            for col in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
                plan[f"{prefix}.{col}"] = ColwiseParallel()
            for row in ("attn.proj", "mlp.proj"):
                plan[f"{prefix}.{row}"] = RowwiseParallel()
        return plan

    def num_pipeline_units(self) -> int:
        return len(self.blocks)

    def fsdp_units(self) -> list[nn.Module]:
        """Modules to shard one by one (each block), before the root."""
        return list(self.blocks.values())

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        if not 0 <= stage_index < num_stages <= len(self.blocks):
            raise ValueError(
                f"pp: cannot cut {len(self.blocks)} blocks into {num_stages} stages "
                f"(stage {stage_index})"
            )
        names = list(self.blocks)
        base, extra = divmod(len(names), num_stages)
        start = stage_index * base + min(stage_index, extra)
        stop = start + base + (1 if stage_index < extra else 0)
        stage = copy.deepcopy(self)
        for name in names[:start] + names[stop:]:
            del stage.blocks[name]
        if stage_index != 0:
            stage.tok_emb = None
            stage.pos_emb = None
        if stage_index != num_stages - 1:
            stage.ln_f = None
            stage.head = None
        return stage


def build_model(seed: int, cfg: GPTConfig | None = None) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(cfg or GPTConfig())


@cache
def build_data(block_size: int = GPTConfig.block_size) -> TaskData:
    """Windows of ``block_size + 1`` characters, half-overlapping; 90/10 split by position."""
    ids = torch.tensor(encode(CORPUS.read_text(encoding="utf-8")), dtype=torch.long)
    cut = int(len(ids) * 0.9)

    def windows(seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = seq.unfold(0, block_size + 1, block_size // 2)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    x_tr, y_tr = windows(ids[:cut])
    x_ev, y_ev = windows(ids[cut:])
    return TaskData(inputs=x_tr, targets=y_tr, eval_inputs=x_ev, eval_targets=y_ev, labels=None)


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def lm_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"accuracy": float((outputs.argmax(dim=-1) == targets).float().mean())}


def task() -> Task:
    """The default: 4 blocks, d_model 64, 4 heads, 32 characters of context."""
    return Task(
        name="gpt",
        build_model=build_model,
        build_data=build_data,
        loss=lm_loss,
        metrics=lm_metrics,
    )


def _lm_task(name: str, config: GPTConfig) -> Task:
    return Task(
        name=name,
        build_model=lambda seed: build_model(seed, config),
        build_data=lambda: build_data(config.block_size),
        loss=lm_loss,
        metrics=lm_metrics,
    )


WIDE = GPTConfig(n_layers=4, d_model=256, n_heads=8, block_size=64)


def task_wide() -> Task:
    """A wider variant (d_model 256, 8 heads, 64 characters) for throughput benchmarks."""
    return _lm_task("gpt-wide", WIDE)


LARGE = GPTConfig(n_layers=4, d_model=1024, n_heads=16, block_size=64)


def task_large() -> Task:
    """The regime tensor and pipeline parallelism are for: d_model 1024 (50.6M parameters)."""
    return _lm_task("gpt-large", LARGE)
