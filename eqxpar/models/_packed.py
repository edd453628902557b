"""Next-token batches of packed documents: what the language models' losses take.

A packed row of [`eqxpar.data.text.PackedRows`][] holds `seq + 1` tokens of one or more
documents, with each token's document (`segment_ids`) and its position in that document
(`positions`). [`eqxpar.models.next_token_batch`][] shifts it into next-token inputs and
targets, and weighs each target by whether it belongs to the same document as its input,
so no document is asked to predict the next one's first token.
"""

from __future__ import annotations

from typing import Any

__all__ = ["next_token_batch", "NEXT_TOKEN_KEYS"]

NEXT_TOKEN_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_weights")
"""The keys of a shifted batch ([`eqxpar.models.next_token_batch`][])."""


def next_token_batch(batch: Any) -> dict[str, Any]:
    """A batch as the language models' losses read it: inputs, targets and, for packed
    documents, the segment ids and positions of the inputs and a weight per target.

    Works on NumPy arrays (to shift a batch on the host before splitting its sequences over
    a context axis) and on JAX arrays (inside a loss).

    **Arguments:**

    - `batch`: one of
        - `(batch, seq + 1)` token ids: plain causal language modelling (every target counts,
          positions `0 .. seq - 1`);
        - a pair `(inputs, targets)` of `(batch, seq)` ids, already shifted;
        - a dict with `"tokens"`, `"segment_ids"`, `"positions"`, each `(batch, seq + 1)` (a
          batch of [`eqxpar.data.text.PackedRows`][] records): shifted here;
        - a dict with the keys of `NEXT_TOKEN_KEYS` (already shifted; e.g. reordered for a
          context axis), each `(batch, seq)`.

    **Returns:**

    A dict with the keys of `NEXT_TOKEN_KEYS`; `segment_ids`, `positions` and
    `loss_weights` are `None` for plain token ids. `loss_weights` is 1 where the target is
    the next token of the input's own document and 0 where it starts another document.

    **Raises:**

    - `ValueError` for a dict without either set of keys.
    """
    if isinstance(batch, dict):
        if "tokens" in batch:
            missing = {"segment_ids", "positions"} - set(batch)
            if missing:
                raise ValueError(
                    f"next_token_batch: a packed batch needs 'tokens', 'segment_ids' and 'positions' (as "
                    f"eqxpar.data.text.PackedRows gives them); missing {sorted(missing)}."
                )
            tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
            return {
                "inputs": tokens[..., :-1],
                "targets": tokens[..., 1:],
                "segment_ids": segments[..., :-1],
                "positions": positions[..., :-1],
                "loss_weights": (segments[..., 1:] == segments[..., :-1]).astype("float32"),
            }
        missing = set(NEXT_TOKEN_KEYS) - set(batch)
        if missing:
            raise ValueError(
                f"next_token_batch: a batch dict needs either 'tokens', 'segment_ids' and 'positions' (unshifted) "
                f"or {', '.join(map(repr, NEXT_TOKEN_KEYS))} (shifted); got keys {sorted(batch)}."
            )
        return {name: batch[name] for name in NEXT_TOKEN_KEYS}
    if isinstance(batch, (tuple, list)):
        inputs, targets = batch
    else:
        inputs, targets = batch[..., :-1], batch[..., 1:]
    return {"inputs": inputs, "targets": targets, "segment_ids": None, "positions": None, "loss_weights": None}
