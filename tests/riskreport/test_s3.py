from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

moto_server = pytest.importorskip("moto.server")

from shadow_traffic import log_shadow_traffic, make_traffic  # noqa: E402

from riskreport import build_report  # noqa: E402
from service.shadow import ExperimentLog  # noqa: E402


@pytest.fixture
def s3() -> Iterator[tuple[pafs.S3FileSystem, str]]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"{host}:{port}"
    fs = pafs.S3FileSystem(
        access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
        endpoint_override=endpoint, allow_bucket_creation=True,
    )  # fmt: skip
    fs.create_dir("experiments")
    yield fs, endpoint
    server.stop()


def test_two_replicas_on_s3_read_as_one_experiment(s3: tuple[pafs.S3FileSystem, str]) -> None:
    fs, endpoint = s3
    traffic = make_traffic(300)
    logs = [
        ExperimentLog("experiments/shadow", replica_id=r, filesystem=fs, flush_interval_s=60)
        for r in ("pod-a", "pod-b")
    ]
    log_shadow_traffic(traffic, logs)
    listing = fs.get_file_info(pafs.FileSelector("experiments/shadow", recursive=True))
    files = sorted(i.path for i in listing if i.type == pafs.FileType.File)
    parts = [f.split("/")[2:] for f in files]
    assert [p[1] for p in parts] == ["model=fraud-demo"] * 2 and parts[0][0].startswith("date=")
    assert [p[2].split("-")[1:3] for p in parts] == [["pod", "a"], ["pod", "b"]]
    report = build_report("experiments/shadow", filesystem=fs, bootstrap_resamples=10)
    assert report.replicas == ("pod-a", "pod-b") and report.records == 600
    assert report.comparisons[0].pairs == 300
    # The same data through a URI, as the CLI would be given it.
    uri = f"s3://testing:testing@experiments/shadow?endpoint_override={endpoint}&scheme=http"
    assert build_report(uri + "&region=us-east-1", bootstrap_resamples=10).records == 600


def test_labels_on_s3(s3: tuple[pafs.S3FileSystem, str]) -> None:
    fs, endpoint = s3
    traffic = make_traffic(200)
    log_shadow_traffic(traffic, [ExperimentLog("experiments/x", replica_id="p", filesystem=fs)])
    table = pa.table({"request_id": traffic.request_ids, "label": traffic.labels})
    pq.write_table(table, "experiments/labels.parquet", filesystem=fs)
    query = f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    report = build_report(
        "experiments/x", filesystem=fs, bootstrap_resamples=10,
        labels_path=f"s3://testing:testing@experiments/labels.parquet{query}",
    )  # fmt: skip
    assert report.arms[0].labels is not None and report.arms[0].labels.labelled == 200
