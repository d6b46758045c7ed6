"""The compare result's schema (fidelity.measuring.result_schema): a real compare result read and written back key for
key and byte for byte, a newer schema version refused naming the file, a file from before versions read as version 0."""
import copy
import json

import pytest

from fidelity import json_out
from fidelity.measuring.compare import compare
from fidelity.measuring.result_schema import SCHEMA_VERSION, CompareReport, Scope, SchemaVersionError
from test_compare import tiny  # noqa: F401  (the module fixture: tiny Llama packs and a panel)


@pytest.fixture(scope="module")
def written(tiny):  # noqa: F811
    """A real compare result (two packs, the noise floor, one pair) as `fidelity compare --json` writes it."""
    res = compare(tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=50, progress=False)
    res.report["command_line"] = "fidelity compare ..."       # what the command adds after the run
    return json_out.dumps(res.report, indent=2) + "\n"


def test_a_real_result_round_trips_key_for_key_and_byte_for_byte(written):
    data = json.loads(written)
    assert list(data)[0] == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    report = CompareReport.read(data, "compare.json")
    assert report.version == SCHEMA_VERSION
    assert report.to_dict() == data
    assert json_out.dumps(report.to_dict(), indent=2) + "\n" == written
    assert report.extra == {"command_line": "fidelity compare ..."}
    # every block typed: nothing compare writes is left to `extra` below the top level
    pack = report.results[0]
    assert isinstance(pack.overall, Scope) and all(isinstance(d, Scope) for d in pack.domains.values())
    assert pack.overall.kld_mean == data["results"][0]["overall"]["kld_mean"]
    assert pack.overall.rows_worse.worse == data["results"][0]["overall"]["rows_worse"]["worse"]
    assert report.paired[0].kld.domains_equal.diff == data["paired"][0]["kld"]["domains_equal"]["diff"]
    assert report.noise_floor.domains_equal.kld_mean == data["noise_floor"]["domains_equal"]["kld_mean"]
    for block in (pack, pack.overall, pack.overall.domains_equal, pack.overall.rows_worse, report.paired[0],
                  report.paired[0].kld, report.panel, report.reference, report.noise_floor):
        assert block.extra == {}, type(block).__name__


def test_a_misspelt_key_is_an_error_not_a_none(written):
    report = CompareReport.read(json.loads(written), "compare.json")
    with pytest.raises(AttributeError):
        report.results[0].overall.kld_maen
    with pytest.raises(KeyError, match="kld_maen"):
        report.results[0].overall["kld_maen"]


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 99])
def test_a_newer_schema_version_is_refused_naming_file_and_versions(written, version):
    data = json.loads(written)
    data["schema_version"] = version
    with pytest.raises(
        SchemaVersionError, match=rf"results/new\.json: .*schema_version {version}.*0 to {SCHEMA_VERSION}"
    ):
        CompareReport.read(data, "results/new.json")


@pytest.mark.parametrize("bad", ["1", -1, 1.0, True, None])
def test_a_schema_version_that_is_no_version_number_is_refused(written, bad):
    data = json.loads(written)
    data["schema_version"] = bad
    with pytest.raises(SchemaVersionError, match=r"x\.json: schema_version .* is not a version number"):
        CompareReport.read(data, "x.json")


def test_a_file_from_before_versions_reads_as_version_0(written):
    """Compare results written before schema_version existed (users' files on disk): today's layout, no key."""
    data = json.loads(written)
    del data["schema_version"]
    old = copy.deepcopy(data)
    del old["results"][0]["overall"]["kld_by_ref_confidence"]      # an older compare wrote fewer keys
    for doc in (data, old):
        report = CompareReport.read(doc, "old.json")
        assert report.version == 0
        assert report.to_dict() == doc and "schema_version" not in report.to_dict()
    assert CompareReport.read(old, "old.json").results[0].overall.kld_by_ref_confidence is None


def test_the_report_refuses_a_newer_compare_result_naming_the_file(written, tmp_path):
    """`fidelity report` reads compare results through the schema: a newer one is an error naming the file, never
    read as if it were today's layout (the old reader took any document with 'panel' and 'results')."""
    from fidelity.report.inputs import ReportInputError, load_inputs

    data = json.loads(written)
    data["schema_version"] = SCHEMA_VERSION + 1
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    with pytest.raises(ReportInputError, match=rf"newer\.json: compare result of schema_version {SCHEMA_VERSION + 1}"):
        load_inputs([newer])
    del data["schema_version"]
    (tmp_path / "v0.json").write_text(json.dumps(data))
    (run,) = load_inputs([tmp_path / "v0.json"]).groups[0].runs
    assert run.report.version == 0 and run.results[0].overall.kld_mean == data["results"][0]["overall"]["kld_mean"]
