"""What the benchmarks keep: logs without the S3 keys vLLM's object tier logs at start."""

from __future__ import annotations

from pathlib import Path

from kvstore.connector.bench.outputs import redact_logs

SECRET, ACCESS = "sk-test-0001-secret", "AKIATEST0001"


def test_keys_are_redacted_from_kept_logs(tmp_path: Path) -> None:
    vllm_log = tmp_path / "obj-rr-node0.log"
    vllm_log.write_text(
        f"kv_transfer_config={{'store_config': {{'access_key': '{ACCESS}', 'secret_key': '{SECRET}'}}}}\n"
        f"again {SECRET}\n"
    )
    clean_log = tmp_path / "ours-rr-node0.log"
    clean_log.write_text("nothing to hide\n")
    other = tmp_path / "report.json"
    other.write_text(SECRET)  # not a log: left as it is

    redact_logs(tmp_path, [SECRET, ACCESS, "short"])

    text = vllm_log.read_text()
    assert SECRET not in text and ACCESS not in text
    assert text.count("[redacted]") == 3 and text.startswith("kv_transfer_config=")
    assert clean_log.read_text() == "nothing to hide\n"
    assert other.read_text() == SECRET


def test_short_strings_are_not_secrets(tmp_path: Path) -> None:
    """A key shorter than 8 bytes would blank out ordinary words of the log: it is not redacted."""
    log = tmp_path / "node.log"
    log.write_text("minio minio\n")
    redact_logs(tmp_path, ["minio"])
    assert log.read_text() == "minio minio\n"
