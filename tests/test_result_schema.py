"""The compare result's schema (fidelity.measuring.result_schema): a real compare result read and written back key for
key and byte for byte, a newer schema version refused naming the file, a file from before versions read as version 0;
what compare writes declared key for key; a value read with its interval as an Estimate."""
import copy
import json

import pytest

from fidelity import json_out
from fidelity.measuring.compare import compare
from fidelity.measuring.result_schema import (
    SCHEMA_VERSION,
    CompareReport,
    Estimate,
    SchemaVersionError,
    Scope,
    UndeclaredKeyError,
)
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


def test_every_key_compare_writes_is_declared(written):
    """The writer's check (`fidelity compare --json` and the demo write through `CompareReport.written`): the real
    result passes unchanged, byte for byte; only the commands' own top-level keys may be undeclared."""
    data = json.loads(written)
    assert json_out.dumps(CompareReport.written(data), indent=2) + "\n" == written
    demo = {**data, "demo_seconds": 61.5}
    assert list(CompareReport.written(demo)) == [*data, "demo_seconds"]


@pytest.mark.parametrize("where", ["top", "scope", "paired", "nested_known_extra"])
def test_a_key_the_schema_does_not_declare_is_refused_when_written_naming_its_path(written, where):
    data = json.loads(written)
    if where == "top":
        data["kld_meen"], path = 1.0, "kld_meen"
    elif where == "scope":
        data["results"][1]["domains"][next(iter(data["results"][1]["domains"]))]["p_value"] = 0.5
        path = rf"results\[1\]\.domains\.{next(iter(data['results'][1]['domains']))}\.p_value"
    elif where == "paired":
        data["paired"][0]["kld"]["domains_equal"]["se"], path = 0.1, r"paired\[0\]\.kld\.domains_equal\.se"
    else:
        data["results"][0]["command_line"], path = "x", r"results\[0\]\.command_line"
    with pytest.raises(UndeclaredKeyError, match=rf"declare: {path} "):
        CompareReport.written(data)
    assert CompareReport.read(data, "x.json").to_dict() == data      # reading still keeps them


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, None])
def test_a_result_is_written_only_in_this_schema_version(written, version):
    data = json.loads(written)
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(SchemaVersionError, match=rf"schema_version {SCHEMA_VERSION}, not {version}"):
        CompareReport.written(data)


def test_an_estimate_reads_the_value_with_its_interval_and_standard_error(written):
    data = json.loads(written)
    report = CompareReport.read(data, "compare.json")
    o, raw = report.results[0].overall, data["results"][0]["overall"]
    assert o.estimate("kld_mean") == Estimate(raw["kld_mean"], raw["kld_mean_ci95"], None)
    assert o.estimate("delta_nll_mean") == Estimate(
        raw["delta_nll_mean"], raw["delta_nll_mean_ci95"], raw["delta_nll_mean_se"])
    assert raw["delta_nll_mean_se"] is not None and len(raw["kld_mean_ci95"]) == 2
    de = data["noise_floor"]["domains_equal"]
    assert report.noise_floor.domains_equal.estimate("delta_nll_mean") == Estimate(
        de["delta_nll_mean"], de["delta_nll_mean_ci95"], de["delta_nll_mean_se"])
    kld = data["paired"][0]["kld"]
    assert report.paired[0].kld.estimate("diff") == Estimate(kld["diff"], kld["diff_ci95"], kld["diff_se"])
    assert report.results[0].overall.rows_worse.estimate("share").ci95 == raw["rows_worse"]["share_ci95"]
    for not_one in ("kld_max", "kld_maen", "absent"):
        with pytest.raises(KeyError, match=not_one):
            o.estimate(not_one)
