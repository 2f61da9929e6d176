"""The alpha Envoy API behind extproc/envoy/usage_record.py, checked against the binary itself.

If an Envoy upgrade renames or renumbers a TokenUsage or AiProtocolManager field, or
stops accepting the config, these fail: the fix belongs in usage_record.py alone.
(The end-to-end check that the usage really arrives is
tests/e2e/test_usage_path.py::test_usage_reaches_extproc_in_the_trailers.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import descriptor_pb2
from google.protobuf.internal.decoder import _DecodeVarint

from bench.procs import envoy_binary
from extproc.envoy import usage_record
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap


def _real_binary() -> Path:
    """The ELF behind the venv's ``envoy`` launcher script."""
    import envoy

    path = Path(envoy.__file__).parent / "_bin" / "envoy"
    assert path.exists(), path
    return path


def binary_descriptor(proto: str) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto compiled into the Envoy binary for ``proto``.

    Serialized descriptors are embedded whole; one starts with field 1 (its name). Read
    top-level fields while they are well formed and parse that span.
    """
    data = _real_binary().read_bytes()
    name = proto.encode()
    start = data.find(b"\x0a" + bytes([len(name)]) + name)
    assert start >= 0, f"{proto} is not in the Envoy binary"
    pos, good = start, start
    while pos < len(data):
        tag, p = _DecodeVarint(data, pos)
        if tag >> 3 == 0 or tag >> 3 > 20 or tag & 7 not in (0, 2):
            break
        if tag & 7 == 2:
            length, p = _DecodeVarint(data, p)
            p += length
        else:
            _, p = _DecodeVarint(data, p)
        try:
            descriptor_pb2.FileDescriptorProto.FromString(data[start:p])
        except Exception:  # noqa: BLE001 - past the end of this descriptor
            break
        pos = good = p
    return descriptor_pb2.FileDescriptorProto.FromString(data[start:good])


def _fields(fd: descriptor_pb2.FileDescriptorProto, message: str) -> dict[str, descriptor_pb2.FieldDescriptorProto]:
    (m,) = [m for m in fd.message_type if m.name == message]
    return {f.name: f for f in m.field}


def test_token_usage_fields_match_the_binary() -> None:
    fd = binary_descriptor("envoy/data/ai/v3/token_usage.proto")
    assert fd.package == "envoy.data.ai.v3"
    fields = _fields(fd, "TokenUsage")
    for name, (number, type_name) in usage_record.TOKEN_USAGE_FIELDS.items():
        assert name in fields, f"TokenUsage.{name} is gone from Envoy"
        assert (fields[name].number, fields[name].type_name) == (number, type_name), name
    (status,) = [e for m in fd.message_type if m.name == "TokenUsage" for e in m.enum_type]
    assert {v.name: v.number for v in status.value}["COMPLETE"] == usage_record.EXTRACTION_COMPLETE


def test_ai_protocol_manager_fields_match_the_binary() -> None:
    fd = binary_descriptor("envoy/extensions/filters/http/ai_protocol_manager/v3/ai_protocol_manager.proto")
    for message, wanted in usage_record.AI_CONFIG_FIELDS.items():
        fields = _fields(fd, message)
        assert {n: fields[n].number for n in wanted if n in fields} == wanted, message
    signal = [e for m in fd.message_type if m.name == "TokenUsageExtraction" for e in m.enum_type]
    assert "SYNTHESIZE_TRAILERS" in {v.name for e in signal for v in e.value}


@pytest.mark.parametrize("mode", ["usage_trailers", "streamed"])
def test_envoy_accepts_both_response_paths(tmp_path: Path, mode: str) -> None:
    cfg = render_bootstrap([BackendRoute("a", "127.0.0.1", 8000), BackendRoute("b", "127.0.0.1", 8001)],
                           EnvoyOptions(response_processing=mode))
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _trailers_with(usage: object | None, type_url: str = "type.googleapis.com/" + usage_record.TOKEN_USAGE):
    req = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    if usage is not None:
        packed = req.metadata_context.typed_filter_metadata[usage_record.USAGE_NAMESPACE]
        packed.type_url = type_url
        packed.value = usage.SerializeToString()  # type: ignore[attr-defined]
    return req


def test_usage_decodes_from_typed_metadata() -> None:
    u = usage_record.TokenUsage()
    u.input_tokens.value, u.output_tokens.value, u.total_tokens.value = 12, 30, 42
    u.extraction_status = usage_record.EXTRACTION_COMPLETE
    assert usage_record.usage_from_metadata(_trailers_with(u)) == usage_record.EnvoyUsage(12, 30, 42, True)
    partial = usage_record.TokenUsage()
    partial.input_tokens.value = 7
    partial.extraction_status = 3  # FAILED
    assert usage_record.usage_from_metadata(_trailers_with(partial)) == usage_record.EnvoyUsage(7, None, None, False)
    assert usage_record.usage_from_metadata(_trailers_with(None)) is None
    assert usage_record.usage_from_metadata(_trailers_with(u, "type.googleapis.com/other.Type")) is None
