"""Coverage-guided fuzzing of the decoders with atheris (outside CI).

Every decoder that reads bytes from a peer is fed libFuzzer's inputs: the client's
``ClientCodec.decode_outputs`` (every protocol profile, one to four frames, plain and
with insecure serialization refused), the engine's ``EngineCodec.decode_input`` and the
handshake decoders. The property is the codec's contract: a decoder returns a message or
raises ``ProtocolError``; any other exception is a crash that libFuzzer reports with the
input that caused it. Decoded outputs are re-encoded and decoded again (round trip), so a
decoder that accepts what the encoder cannot reproduce is caught too.

Not a pytest test (atheris is not a dependency). Run it, e.g. for five minutes::

    .venv/bin/pip install atheris
    .venv/bin/python tests/reliability/atheris_decoder.py --seed-corpus /tmp/decoder-corpus
    .venv/bin/python tests/reliability/atheris_decoder.py -max_total_time=300 \\
        -rss_limit_mb=2048 /tmp/decoder-corpus

``--seed-corpus DIR`` writes seeds (the shared wire vectors when ``../shared/wire-vectors``
exists, plus encoded outputs of every profile) and exits. Other arguments go to
libFuzzer (``-help=1`` lists them); a crash leaves ``crash-<sha1>`` in the current
directory, to replay with ``atheris_decoder.py crash-<sha1>``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["trio_vllm"]):
    from trio_vllm import ProtocolError
    from trio_vllm.protocol import (
        PROFILES,
        ClientCodec,
        EngineCodec,
        EngineCoreDead,
        EngineCoreOutput,
        EngineCoreOutputs,
        FinishReason,
        UtilityOutput,
        UtilityResult,
        decode_handshake_metadata,
        decode_hello,
        decode_ready,
        decode_ready_response,
    )

_PROFILES = list(PROFILES.values())
CLIENTS = [ClientCodec(p) for p in _PROFILES]
ENGINES = [EngineCodec(p) for p in _PROFILES]
HANDSHAKE = [decode_hello, decode_ready, decode_ready_response, decode_handshake_metadata]


def _split(raw: bytes) -> tuple[int, int, list[bytes]]:
    """``[target][profile][count]`` then ``count - 1`` frames of ``[len u16 LE][bytes]``
    and a last frame of whatever remains (the seeds use the same layout)."""
    if len(raw) < 3:
        return 0, 0, [raw]
    target, which, count = raw[0] % 3, raw[1] % len(_PROFILES), raw[2] % 4 + 1
    rest = raw[3:]
    frames = []
    for _ in range(count - 1):
        size = int.from_bytes(rest[:2], "little")
        frames.append(rest[2 : 2 + size])
        rest = rest[2 + size :]
    frames.append(rest)
    return target, which, frames


def test_one_input(raw: bytes) -> None:
    target, which, frames = _split(raw)
    if target == 0:
        codec = CLIENTS[which]
        try:
            out = codec.decode_outputs(frames)
        except ProtocolError:
            return
        if isinstance(out, EngineCoreDead):
            return
        assert isinstance(out, EngineCoreOutputs), type(out)
        # Round trip: what the client accepted, the engine side can encode, and the
        # client decodes that back to the same message.
        try:
            again = codec.decode_outputs(ENGINES[which].encode_outputs(out))
        except ProtocolError as exc:
            raise AssertionError(f"accepted {out!r} but not its re-encoding: {exc}") from None
        assert isinstance(again, EngineCoreOutputs)
        assert len(again.outputs) == len(out.outputs)
        assert [o.request_id for o in again.outputs] == [o.request_id for o in out.outputs]
    elif target == 1:
        try:
            ENGINES[which].decode_input(frames)
        except ProtocolError:
            return
    else:
        decoder = HANDSHAKE[which % len(HANDSHAKE)]
        try:
            decoder(frames[0])
        except ProtocolError:
            return


def _seed(corpus: Path) -> int:
    """Write seed inputs laid out as :func:`test_one_input` reads them."""
    corpus.mkdir(parents=True, exist_ok=True)
    seeds: list[bytes] = []

    def add(target: int, profile: int, frames: list[bytes]) -> None:
        body = b"".join(len(f).to_bytes(2, "little") + f for f in frames[:-1])
        seeds.append(bytes([target, profile, len(frames) - 1]) + body + frames[-1])

    for i, codec in enumerate(ENGINES):
        message = EngineCoreOutputs(
            outputs=[
                EngineCoreOutput("r1", new_token_ids=[1, 2, 3]),
                EngineCoreOutput("r2", new_token_ids=[4], finish_reason=FinishReason.LENGTH),
            ],
            utility_output=UtilityOutput(7, None, UtilityResult(None, [1, "x"])),
        )
        add(0, i, [bytes(f) for f in codec.encode_outputs(message)])
    vectors = Path(__file__).resolve().parents[3] / "shared" / "wire-vectors"
    if vectors.is_dir():
        for path in sorted(vectors.glob("vllm-*/*.json")):
            if path.name == "INDEX.json":
                continue
            vector: dict[str, Any] = json.loads(path.read_text())
            frames = [base64.b64decode(f) for f in vector.get("frames_b64", [])]
            if not frames:
                continue
            version = path.parent.name.removeprefix("vllm-")
            index = next((i for i, p in enumerate(_PROFILES) if p.vllm_version == version), 0)
            target = {"output": 0, "input": 1}.get(vector.get("socket", ""), 2)
            add(target, index, frames)
    for seed in seeds:
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    return len(seeds)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--seed-corpus":
        print(f"wrote {_seed(Path(sys.argv[2]))} seeds to {sys.argv[2]}")
        return
    os.environ.setdefault("PYTHONHASHSEED", "0")
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
