"""A deterministic toy model split into pipeline stages: no weights to download.

The model is a stack of `num_layers` layers; a pipeline stage holds a contiguous
range of them, so a single-stage run computes exactly what a pipeline computes.
Each layer keeps a per-slot, per-position cache (the analogue of a KV cache): the
value at position p folds the layer's input at p into the value at p - 1. So the
token sampled at a position depends on every stage and on the whole history of
its request, and a rejected draft is corrected simply by recomputing its position
later, as a real engine overwrites rejected KV entries.

The last stage turns its output into a token: most of the time the next token is
the input token plus one (so a drafter that guesses "plus one" is often right),
otherwise a token derived from the hidden value (so drafts are sometimes wrong).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "MODULUS",
    "ForwardPlan",
    "LayerWeights",
    "ToyStage",
    "layers_of_stage",
    "next_token_rule",
    "propose_drafts",
    "reference_generate",
]

MODULUS = 2_147_483_647  # a prime below 2**31: every product of two residues fits in int64
_EMBED_TOKEN = 1_000_003
_EMBED_POS = 7_919


@attrs.frozen
class LayerWeights:
    """The three multipliers of one layer, drawn from the layer index alone."""

    fold: int  # weight of the previous position's cache value
    mix: int  # weight of the cache value in the output
    skip: int  # weight of the input in the output

    @classmethod
    def of(cls, layer: int) -> LayerWeights:
        rng = np.random.default_rng(10_007 + layer)
        fold, mix, skip = (int(w) for w in rng.integers(2, MODULUS - 1, size=3))
        return cls(fold=fold, mix=mix, skip=skip)


@attrs.frozen(kw_only=True)
class ForwardPlan:
    """Host-side layout of one step's tokens, padded to the agreed token count.

    Rows of one request are consecutive; `offset_rows[j]` lists the rows that are
    the j-th token of their request, so position p is computed before p + 1.
    """

    num_tokens: int  # padded row count (the agreed batch shape)
    slots: npt.NDArray[np.int64]  # [rows] request slot per real row
    positions: npt.NDArray[np.int64]  # [rows] position in the request per real row
    token_ids: npt.NDArray[np.int64]  # [rows] input token id per real row
    offset_rows: tuple[npt.NDArray[np.int64], ...]  # rows by offset within their request
    last_rows: npt.NDArray[np.int64]  # [num_reqs] row of each request's last scheduled token

    @classmethod
    def build(
        cls,
        num_tokens: int,
        slots: list[int],
        start_positions: list[int],
        token_ids: list[list[int]],
    ) -> ForwardPlan:
        """`token_ids[i]` are the tokens scheduled for request i at positions
        `start_positions[i]`, `start_positions[i] + 1`, ..."""
        row_slots: list[int] = []
        row_positions: list[int] = []
        row_tokens: list[int] = []
        by_offset: list[list[int]] = []
        last_rows: list[int] = []
        for slot, start, tokens in zip(slots, start_positions, token_ids, strict=True):
            for offset, token in enumerate(tokens):
                if offset == len(by_offset):
                    by_offset.append([])
                by_offset[offset].append(len(row_slots))
                row_slots.append(slot)
                row_positions.append(start + offset)
                row_tokens.append(token)
            last_rows.append(len(row_slots) - 1)
        return cls(
            num_tokens=num_tokens,
            slots=np.array(row_slots, dtype=np.int64),
            positions=np.array(row_positions, dtype=np.int64),
            token_ids=np.array(row_tokens, dtype=np.int64),
            offset_rows=tuple(np.array(rows, dtype=np.int64) for rows in by_offset),
            last_rows=np.array(last_rows, dtype=np.int64),
        )

    @property
    def num_real_rows(self) -> int:
        return int(self.slots.shape[0])


def layers_of_stage(stage: int, pp_size: int, num_layers: int) -> range:
    """The contiguous layers a stage holds; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _layer(
    weights: LayerWeights, layer: int, folded: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    return (folded * weights.mix % MODULUS + x * weights.skip % MODULUS + layer) % MODULUS


def _embed(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (tokens * _EMBED_TOKEN + positions * _EMBED_POS + 1) % MODULUS


class ToyStage:
    """One pipeline stage of the toy model, holding its layers' caches on `device`."""

    def __init__(
        self, layers: range, max_num_reqs: int, max_model_len: int, device: torch.device
    ) -> None:
        self.layers = layers
        self.weights = [LayerWeights.of(layer) for layer in layers]
        self.device = device
        self.cache = torch.zeros(
            (len(layers), max_num_reqs, max_model_len), dtype=torch.int64, device=device
        )

    def forward(self, plan: ForwardPlan, inputs: torch.Tensor | None) -> torch.Tensor:
        """Return this stage's [plan.num_tokens] int64 outputs.

        `inputs` are the previous stage's outputs; None on the first stage, which
        embeds the plan's token ids instead. Padding rows stay zero.
        """
        device = self.device
        slots = torch.from_numpy(plan.slots).to(device)
        positions = torch.from_numpy(plan.positions).to(device)
        if inputs is None:
            real_inputs = _embed(torch.from_numpy(plan.token_ids).to(device), positions)
        else:
            real_inputs = inputs[: plan.num_real_rows]
        outputs = torch.zeros(plan.num_tokens, dtype=torch.int64, device=device)
        for rows_np in plan.offset_rows:
            rows = torch.from_numpy(rows_np).to(device)
            row_slots = slots[rows]
            row_positions = positions[rows]
            has_previous = row_positions > 0
            previous_positions = (row_positions - 1).clamp(min=0)
            x = real_inputs[rows]
            for index, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
                cache = self.cache[index]
                previous = cache[row_slots, previous_positions]
                previous = torch.where(has_previous, previous, torch.zeros_like(previous))
                folded = (previous * w.fold + x) % MODULUS
                cache[row_slots, row_positions] = folded
                x = _layer(w, layer, folded, x)
            outputs[rows] = x
        return outputs

    def reset_slot(self, slot: int) -> None:
        """Forget a freed slot's history (a new request starts from position 0)."""
        self.cache[:, slot].zero_()


def next_token_rule(
    hidden: torch.Tensor, input_tokens: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The token predicted after each row: usually input + 1, else hidden-derived."""
    follow = (input_tokens + 1) % vocab_size
    jump = (hidden // 4) % vocab_size
    return torch.where(hidden % 4 != 0, follow, jump)


def propose_drafts(last_token: int, num_drafts: int, vocab_size: int, corrupt: bool) -> list[int]:
    """The drafter's guess: the next tokens count up from the last one. With
    `corrupt`, the first guess is deliberately wrong (a forced rejection)."""
    drafts = [(last_token + j) % vocab_size for j in range(1, num_drafts + 1)]
    if corrupt and drafts:
        drafts[0] = (drafts[0] + vocab_size // 2) % vocab_size
    return drafts


def reference_generate(
    prompt: tuple[int, ...], max_tokens: int, num_layers: int, vocab_size: int
) -> list[int]:
    """Greedy output tokens of the toy model for one request, on the host with
    plain integers, one token at a time: the ground truth for the runner."""
    weights = [LayerWeights.of(layer) for layer in range(num_layers)]
    caches: list[list[int]] = [[] for _ in range(num_layers)]
    history = list(prompt)
    outputs: list[int] = []
    position = 0
    while len(outputs) < max_tokens:
        token = history[position]
        x = (token * _EMBED_TOKEN + position * _EMBED_POS + 1) % MODULUS
        for layer, w in enumerate(weights):
            previous = caches[layer][position - 1] if position > 0 else 0
            folded = (previous * w.fold + x) % MODULUS
            caches[layer].append(folded)
            x = (folded * w.mix % MODULUS + x * w.skip % MODULUS + layer) % MODULUS
        position += 1
        if position == len(history):
            nxt = (token + 1) % vocab_size if x % 4 != 0 else (x // 4) % vocab_size
            history.append(nxt)
            outputs.append(nxt)
    return outputs
