"""Sampling defaults from a generation config, as vLLM's ``--generation-config`` gives them.

vLLM 0.32.0's rules, without I/O:

* ``ModelConfig.get_diff_sampling_param``: the generation config (none for
  ``--generation-config vllm``), updated with ``--override-generation-config``; of its
  keys ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
  ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens`` (renamed
  ``max_tokens``) those that are set. transformers 5 has no non-``None`` defaults for
  them, so ``to_diff_dict`` keeps every value the file sets.
* The OpenAI serving layer's ``override_max_tokens``: with a generation-config
  directory, its ``max_tokens`` caps every request; with ``auto`` or ``vllm`` only the
  override's ``max_new_tokens`` does. `SamplingDefaults.max_tokens` is ``get_max_tokens``.
* ``to_sampling_params``: the request's value, else the server default, else the
  OpenAI default (`SamplingDefaults.value`).
* ``LLM.get_default_sampling_params``: ``SamplingParams(**defaults)`` when a call
  gives no params (`SamplingDefaults.sampling_params`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

import msgspec

from ..protocol import SamplingParams

__all__ = ["GENERATION_CONFIG_KEYS", "OPENAI_SAMPLING_DEFAULTS", "SamplingDefaults"]

# The keys vLLM's get_diff_sampling_param takes from a generation config, in its order.
GENERATION_CONFIG_KEYS: Final = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
# vLLM's _DEFAULT_SAMPLING_PARAMS of the completion and chat requests.
OPENAI_SAMPLING_DEFAULTS: Final[Mapping[str, float | int]] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
_INT_KEYS: Final = frozenset({"top_k", "max_new_tokens"})


def _number(key: str, value: object) -> float | int:
    # vLLM passes any type on and fails each request later; refusing at load is clearer.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"generation config: {key} must be a number, got {value!r}")
    if key in _INT_KEYS and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"generation config: {key} must be an integer, got {value!r}")
        return int(value)
    return value


class SamplingDefaults(Mapping[str, float | int]):
    """A model's default sampling values (vLLM's ``default_sampling_params``).

    A read-only mapping with vLLM's names (``max_tokens``, not ``max_new_tokens``),
    plus ``max_tokens_cap`` (vLLM's ``override_max_tokens``: a limit on every request's
    ``max_tokens``, or ``None``) and ``source`` (``"auto"``, ``"vllm"`` or the
    directory). Build one with `from_generation_config`; ``SamplingDefaults()`` is
    ``--generation-config vllm`` with no override.
    """

    __slots__ = ("_values", "max_tokens_cap", "source")

    def __init__(
        self,
        values: Mapping[str, float | int] | None = None,
        *,
        max_tokens_cap: int | None = None,
        source: str = "vllm",
    ) -> None:
        self._values: dict[str, float | int] = dict(values or {})
        self.max_tokens_cap = max_tokens_cap
        self.source = source

    @classmethod
    def from_generation_config(
        cls,
        generation_config: Mapping[str, object] | None,
        *,
        source: str = "auto",
        override: Mapping[str, object] | None = None,
    ) -> SamplingDefaults:
        """vLLM's ``get_diff_sampling_param`` and ``override_max_tokens``.

        ``generation_config`` is the parsed generation config of the model (``auto``) or
        of the directory ``source``; it is ignored for ``source="vllm"``. ``override``
        is ``--override-generation-config``: it updates the config, and applies with
        ``vllm`` too. Raises ``ValueError`` for a value that is not a number (an
        integer for ``top_k`` and ``max_new_tokens``).
        """
        config: dict[str, object] = {} if source == "vllm" else dict(generation_config or {})
        config.update(override or {})
        values: dict[str, float | int] = {}
        for key in GENERATION_CONFIG_KEYS:
            value = config.get(key)
            if value is None:
                continue
            values["max_tokens" if key == "max_new_tokens" else key] = _number(key, value)
        cap: float | int | None
        if source in ("auto", "vllm"):
            raw = (override or {}).get("max_new_tokens")
            cap = None if raw is None else _number("max_new_tokens", raw)
        else:
            cap = values.get("max_tokens")
        return cls(values, max_tokens_cap=None if cap is None else int(cap), source=source)

    # -- Mapping --------------------------------------------------------------------------

    def __getitem__(self, key: str) -> float | int:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        cap = "" if self.max_tokens_cap is None else f", max_tokens_cap={self.max_tokens_cap}"
        return f"SamplingDefaults({self._values!r}{cap}, source={self.source!r})"

    # -- the merge rules ------------------------------------------------------------------

    def value(self, name: str, requested: float | None) -> float | int:
        """A request's sampling field: its own value, else this default, else OpenAI's
        (``name`` is one of `OPENAI_SAMPLING_DEFAULTS`)."""
        if requested is not None:
            return requested
        return self._values.get(name, OPENAI_SAMPLING_DEFAULTS[name])

    def max_tokens(self, requested: int | None, room: int) -> int:
        """vLLM's ``get_max_tokens``: the smallest of the room the prompt leaves, the
        request's ``max_tokens`` (else this default) and ``max_tokens_cap``."""
        fallback = self._values.get("max_tokens") if requested is None else requested
        limits = [room]
        if fallback is not None:
            limits.append(int(fallback))
        if self.max_tokens_cap is not None:
            limits.append(self.max_tokens_cap)
        return min(limits)

    def sampling_params(self, **fields: object) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params``: ``SamplingParams`` with these
        defaults (``max_tokens`` stays 16 unless set), then ``fields`` on top."""
        params = SamplingParams(**self._values)  # type: ignore[arg-type]
        return msgspec.structs.replace(params, **fields) if fields else params
