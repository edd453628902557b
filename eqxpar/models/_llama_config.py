"""The shape of a Llama-style model (`LlamaConfig`), its rotary-embedding frequency scaling
and named presets: a CPU demo, Llama-3.2-1B's shape and Llama-3-8B's."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["LlamaConfig", "LlamaRopeScaling", "LLAMA_CONFIGS", "llama_config"]


def _positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0


def _positive_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) > 0


@dataclasses.dataclass(frozen=True)
class LlamaRopeScaling:
    """Llama 3's rotary-embedding frequency scaling (Hugging Face's `rope_type="llama3"`).

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep
    their frequency, those longer than `original_max_position_embeddings /
    low_freq_factor` are divided by `factor`, and the ones between are interpolated
    smoothly. [`eqxpar.models.LlamaConfig`][] takes it as this class or as the dict of a
    Hugging Face `config.json`'s `rope_scaling` entry.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not _positive_real(getattr(self, name)):
                raise ValueError(f"LlamaRopeScaling: {name} must be a positive number, got {getattr(self, name)!r}.")
        if not _positive_int(self.original_max_position_embeddings):
            raise ValueError(
                f"LlamaRopeScaling: original_max_position_embeddings must be a positive integer, got "
                f"{self.original_max_position_embeddings!r}."
            )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"LlamaRopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor}) (Llama 3 uses 4.0 and 1.0)."
            )

    @classmethod
    def from_dict(cls, scaling: Mapping[str, Any]) -> LlamaRopeScaling:
        """The scaling from a Hugging Face `rope_scaling` dict (its `rope_type`, if any,
        must be `"llama3"`).

        **Arguments:**

        - `scaling`: a mapping with `factor`, `low_freq_factor`, `high_freq_factor` and
          `original_max_position_embeddings`.

        **Returns:**

        A `LlamaRopeScaling`.

        **Raises:**

        - `ValueError` for another `rope_type`, a missing or unknown key.
        """
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", scaling.pop("type", "llama3"))
        if rope_type != "llama3":
            raise ValueError(
                f"LlamaConfig: rope_scaling of rope_type {rope_type!r} is not supported; only Llama 3's "
                f"'llama3' scaling (or rope_scaling=None)."
            )
        names = [field.name for field in dataclasses.fields(cls)]
        if set(scaling) != set(names):
            raise ValueError(
                f"LlamaConfig: rope_scaling needs exactly the keys {names} (and optionally "
                f"rope_type='llama3'), got {sorted(scaling)}."
            )
        return cls(**scaling)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a [`eqxpar.models.Llama`][] (Hugging Face's `LlamaConfig` names in
    brackets).

    - `vocab_size` [`vocab_size`]: token ids; split over the model axis, so it must be a
      multiple of the model axis size.
    - `dim` [`hidden_size`]: the residual stream's width.
    - `num_layers` [`num_hidden_layers`]: transformer blocks.
    - `num_heads` [`num_attention_heads`]: query heads.
    - `num_kv_heads` [`num_key_value_heads`]: key/value heads (grouped-query attention:
      each serves `num_heads / num_kv_heads` query heads; `1` is multi-query attention).
      Default: `num_heads`.
    - `head_dim` [`head_dim`]: channels per head. Default `dim // num_heads`.
    - `hidden_dim` [`intermediate_size`]: the SwiGLU MLP's width.
    - `rope_theta` [`rope_theta`]: the rotary embedding's base.
    - `rope_scaling` [`rope_scaling`]: `None`, or Llama 3's frequency scaling as a
      [`eqxpar.models.LlamaRopeScaling`][] or its Hugging Face dict (stored as the former).
    - `norm_eps` [`rms_norm_eps`]: the RMS norms' epsilon.
    - `tie_embeddings` [`tie_word_embeddings`]: the output head reuses the token embedding.
    - `max_seq_len` [`max_position_embeddings`]: the longest sequence the model takes.

    **Raises:**

    - `ValueError` for a non-positive size, `num_heads` not a multiple of `num_kv_heads`,
      an odd `head_dim` (rotary embeddings rotate pairs of channels) or an unknown
      `rope_scaling`.
    """

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: LlamaRopeScaling | Mapping[str, Any] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "hidden_dim", "max_seq_len"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"LlamaConfig: {name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.dim % self.num_heads:
                raise ValueError(
                    f"LlamaConfig: head_dim defaults to dim // num_heads, but dim={self.dim} is not a multiple of "
                    f"num_heads={self.num_heads}; pass head_dim explicitly or choose dim a multiple of num_heads."
                )
            object.__setattr__(self, "head_dim", self.dim // self.num_heads)
        for name in ("num_kv_heads", "head_dim"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"LlamaConfig: {name} must be a positive integer, got {getattr(self, name)!r}.")
        assert self.num_kv_heads is not None and self.head_dim is not None  # set above
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} "
                f"(grouped-query attention gives every key/value head the same number of query heads); choose "
                f"num_kv_heads a divisor of num_heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim={self.head_dim} must be even (rotary embeddings rotate pairs of channels)."
            )
        for name in ("rope_theta", "norm_eps"):
            if not _positive_real(getattr(self, name)):
                raise ValueError(f"LlamaConfig: {name} must be a positive number, got {getattr(self, name)!r}.")
        if isinstance(self.tie_embeddings, str) or self.tie_embeddings not in (True, False):
            raise ValueError(f"LlamaConfig: tie_embeddings must be True or False, got {self.tie_embeddings!r}.")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", LlamaRopeScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, LlamaRopeScaling):
            raise ValueError(
                f"LlamaConfig: rope_scaling must be None, a LlamaRopeScaling or Hugging Face's rope_scaling dict, "
                f"got {self.rope_scaling!r}."
            )

    @property
    def kv_heads(self) -> int:
        """`num_kv_heads` as an `int` (always set after construction)."""
        assert self.num_kv_heads is not None
        return self.num_kv_heads

    @property
    def scaling(self) -> LlamaRopeScaling | None:
        """`rope_scaling` as a `LlamaRopeScaling` (a dict is converted at construction)."""
        assert self.rope_scaling is None or isinstance(self.rope_scaling, LlamaRopeScaling)
        return self.rope_scaling

    @property
    def channels(self) -> int:
        """`head_dim` as an `int` (always set after construction)."""
        assert self.head_dim is not None
        return self.head_dim


# Named shapes. "tiny" trains on a CPU in seconds (every width splits over 1, 2, 4 or 8
# devices). The others are the shapes of published checkpoints, every number from the
# model's Hugging Face config.json:
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, hidden_dim=192, max_seq_len=256
    ),
    # meta-llama/Llama-3.2-1B config.json: vocab_size 128256, hidden_size 2048,
    # num_hidden_layers 16, num_attention_heads 32, num_key_value_heads 8, head_dim 64,
    # intermediate_size 8192, rope_theta 500000.0, rope_scaling {factor 32.0,
    # low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192,
    # rope_type "llama3"}, rms_norm_eps 1e-05, tie_word_embeddings true,
    # max_position_embeddings 131072.
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        hidden_dim=8192,
        rope_theta=500000.0,
        rope_scaling=LlamaRopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=131072,
    ),
    # meta-llama/Meta-Llama-3-8B config.json: vocab_size 128256, hidden_size 4096,
    # num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8 (head_dim
    # 4096 / 32 = 128), intermediate_size 14336, rope_theta 500000.0, rope_scaling null,
    # rms_norm_eps 1e-05, tie_word_embeddings false, max_position_embeddings 8192.
    "llama-3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        hidden_dim=14336,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        max_seq_len=8192,
    ),
}


def llama_config(name: str, **changes: Any) -> LlamaConfig:
    """The named Llama shape, with any fields changed.

    **Arguments:**

    - `name`: one of `LLAMA_CONFIGS` ("tiny", "llama-3.2-1b", "llama-3-8b").
    - `**changes`: fields to replace, e.g. `num_layers=2` or `vocab_size=512`.

    **Returns:**

    A [`eqxpar.models.LlamaConfig`][].

    **Raises:**

    - `ValueError` for an unknown name or field, listing the known ones.
    """
    if name not in LLAMA_CONFIGS:
        raise ValueError(f"llama_config: unknown Llama config {name!r}; choose one of {sorted(LLAMA_CONFIGS)}.")
    fields = [field.name for field in dataclasses.fields(LlamaConfig)]
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise ValueError(f"llama_config: unknown LlamaConfig fields {unknown}; the fields are {fields}.")
    base = LLAMA_CONFIGS[name]
    if "head_dim" not in changes and base.head_dim == base.dim // base.num_heads:
        changes["head_dim"] = None  # derived from dim and num_heads: derive it again from the new ones
    return dataclasses.replace(base, **changes)
