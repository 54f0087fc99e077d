"""course_lib.records: recorded figures round trip, COURSE_RECORDS=off writes nothing, `measured_or_recorded`
measures on a GPU and shows the record elsewhere, and the committed records are stamped."""

import json

import pytest

import course_lib
from course_lib import records


def test_records_round_trip(tmp_path):
    path = records.save_record("demo", {"x": [1, 2]}, folder=tmp_path)
    rec = json.loads(path.read_text())
    assert rec["kind"] == "demo" and rec["data"] == {"x": [1, 2]}
    for key in ("date", "torch", "triton", "gpu"):
        assert key in rec["meta"]
    assert records.load_record("demo", folder=tmp_path)["data"]["x"] == [1, 2]
    assert records.load_record("absent", folder=tmp_path) is None
    assert "recorded on" in records.label(rec)
    # a file that is not a record is named, not a bare JSONDecodeError or KeyError from every load
    (tmp_path / "demo-broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"demo-broken\.json is not a record of course_lib"):
        records.load_record("demo", folder=tmp_path)
    (tmp_path / "demo-broken.json").write_text('{"kind": "demo", "data": {}}')
    with pytest.raises(ValueError, match=r"demo-broken\.json is not a record .*KeyError"):
        records.load_record("demo", folder=tmp_path)
    if not course_lib.ON_GPU:
        with pytest.raises(ValueError, match="measure_here=True needs a GPU"):
            records.measured_or_recorded("demo", lambda: {"x": 1}, "none", folder=tmp_path, measure_here=True)


def test_records_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RECORDS", "off")
    assert records.save_record("demo", {"x": [1]}, folder=tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_measured_or_recorded_shows_the_record_on_the_cpu(tmp_path, capsys):
    if course_lib.ON_GPU:
        pytest.skip("the CPU path")

    def measure():
        raise AssertionError("measure() must not run on the CPU")

    assert records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path) is None
    assert "no record yet" in capsys.readouterr().out
    records.save_record("demo", {"x": [1, 2]}, folder=tmp_path)
    data, source = records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path)
    assert data == {"x": [1, 2]} and source.startswith("recorded on"), (data, source)
    with pytest.raises(TypeError, match="measure"):
        records.measured_or_recorded("demo", {"x": 1}, "", folder=tmp_path)
    with pytest.raises(ValueError, match="kind"):
        records.measured_or_recorded("", measure, "", folder=tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_measured_or_recorded_measures_and_saves_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_RECORDS", raising=False)
    data, source = records.measured_or_recorded("demo", lambda: {"x": [3]}, "unused", folder=tmp_path)
    assert data == {"x": [3]} and source.startswith("measured now on"), source
    assert records.load_record("demo", folder=tmp_path)["data"] == {"x": [3]}


def test_measured_or_recorded_measure_here_false_shows_the_record(tmp_path, capsys):
    """measure_here=False (a figure this GPU cannot measure) shows the record on any machine."""

    def measure():
        raise AssertionError("measure() must not run with measure_here=False")

    got = records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path, measure_here=False)
    assert got is None and "no record yet" in capsys.readouterr().out
    records.save_record("demo", {"x": [4]}, folder=tmp_path)
    data, source = records.measured_or_recorded("demo", measure, "", folder=tmp_path, measure_here=False)
    assert data == {"x": [4]} and source.startswith("recorded on"), (data, source)


def test_committed_records_are_stamped():
    for path in records.ASSETS.glob("*.json"):
        meta = json.loads(path.read_text())["meta"]
        assert meta.get("gpu") and meta.get("date") and meta.get("torch"), f"{path.name}: incomplete stamp"
