"""The client's init metadata (reply to HELLO) is encoded by the codec, byte for byte."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_vllm.protocol import codec, decode_handshake_metadata, handshake
from trio_vllm.protocol.handshake import encode_init_metadata

if TYPE_CHECKING:
    import pytest

_address = st.integers(1, 65535).map(lambda port: f"tcp://127.0.0.1:{port}")
_optional = st.none() | _address
_config = st.dictionaries(
    st.sampled_from(["data_parallel_size", "data_parallel_rank", "ranks", "mode"]),
    st.integers(0, 1 << 20) | st.text(max_size=8) | st.lists(st.integers(0, 64), max_size=4),
    max_size=4,
)


def _by_hand(
    inputs: list[str],
    outputs: list[str],
    ci: str | None,
    co: str | None,
    stats: str | None,
    config: dict[str, Any],
) -> bytes:
    """The layout of vLLM's EngineHandshakeMetadata, written out as plain maps."""
    return msgspec.msgpack.encode(
        {
            "addresses": {
                "inputs": inputs,
                "outputs": outputs,
                "coordinator_input": ci,
                "coordinator_output": co,
                "frontend_stats_publish_address": stats,
            },
            "parallel_config": config,
        }
    )


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(st.tuples(_address, _address), min_size=1, max_size=4),
    ci=_optional,
    co=_optional,
    stats=_optional,
    config=_config,
)
def test_init_metadata_bytes_unchanged(
    pairs: list[tuple[str, str]],
    ci: str | None,
    co: str | None,
    stats: str | None,
    config: dict[str, Any],
) -> None:
    inputs = [i for i, _ in pairs]
    outputs = [o for _, o in pairs]
    encoded = encode_init_metadata(
        inputs=inputs,
        outputs=outputs,
        coordinator_input=ci,
        coordinator_output=co,
        frontend_stats_publish_address=stats,
        parallel_config=config,
    )
    assert encoded == _by_hand(inputs, outputs, ci, co, stats, config)
    decoded = decode_handshake_metadata(encoded)
    assert decoded.addresses.inputs == inputs
    assert decoded.addresses.coordinator_output == co
    assert decoded.parallel_config == config


def test_init_metadata_goes_through_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = codec.encode_handshake_metadata

    def spy(metadata: Any) -> bytes:
        calls.append(metadata)
        return real(metadata)

    monkeypatch.setattr(handshake, "encode_handshake_metadata", spy, raising=True)
    encode_init_metadata(inputs=["tcp://127.0.0.1:1"], outputs=["tcp://127.0.0.1:2"])
    assert len(calls) == 1
