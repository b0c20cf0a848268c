"""The engine-side output encoding of older layouts (tuple fast path) is byte-identical to
the list-by-index conversion it replaced, for plain and special outputs."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_vllm.protocol import (
    EngineCodec,
    EngineCoreOutput,
    EngineCoreOutputs,
    profile_for_version,
)
from trio_vllm.protocol.codec import _Layouts

_VERSIONS = ("0.25.1", "0.32.0", "0.33.0")

_output = st.builds(
    EngineCoreOutput,
    request_id=st.text(min_size=1, max_size=12),
    new_token_ids=st.lists(st.integers(0, 1 << 20), max_size=6),
    finish_reason=st.none() | st.integers(0, 3),
    stop_reason=st.none() | st.integers(0, 300) | st.text(max_size=4),
    pooling_output=st.none()
    | st.lists(st.floats(-4, 4, width=32), min_size=1, max_size=4).map(
        lambda xs: np.asarray(xs, dtype=np.float32)
    ),
)


def _old_output(lay: _Layouts, out: EngineCoreOutput) -> Any:
    """The previous conversion, by list and index (what the wire vectors were checked
    against); special fields go through the layouts' own helpers as before."""
    if lay.output_idx is None or isinstance(out.pooling_output, np.ndarray):
        return lay.output(out)
    values = list(msgspec.structs.astuple(out))
    return [values[i] for i in lay.output_idx]


@settings(max_examples=150, deadline=None)
@given(outputs=st.lists(_output, max_size=8), version=st.sampled_from(_VERSIONS))
def test_fast_path_bytes_equal_old_conversion(
    outputs: list[EngineCoreOutput], version: str
) -> None:
    profile = profile_for_version(version)
    codec = EngineCodec(profile)
    lay = _Layouts(profile)
    message = EngineCoreOutputs(engine_index=1, outputs=outputs)
    new = b"".join(bytes(f) for f in codec.encode_outputs(message))
    values = list(msgspec.structs.astuple(message))
    converted = [_old_output(lay, o) for o in outputs]
    if lay.outputs_idx is None and all(c is o for c, o in zip(converted, outputs, strict=True)):
        reference: Any = message
    else:
        names = list(message.__struct_fields__)
        values[names.index("outputs")] = converted
        reference = values if lay.outputs_idx is None else [values[i] for i in lay.outputs_idx]
    old = codec._encode(None, reference)
    assert new == b"".join(bytes(f) for f in old)


def test_plain_outputs_take_the_tuple_path() -> None:
    plain = EngineCoreOutput("r", [1, 2])
    for version in ("0.25.1", "0.32.0"):
        assert isinstance(_Layouts(profile_for_version(version)).output(plain), tuple)
    assert _Layouts(profile_for_version("0.33.0")).output(plain) is plain
