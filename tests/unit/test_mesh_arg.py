"""Tier 1: the one mesh syntax of every ``mopd`` command (profiling/mesh_arg.py)."""

from __future__ import annotations

import argparse

import pytest

from mopd.profiling.mesh_arg import (
    MeshSpec,
    OneLineParser,
    mesh_type,
    parse_int_list,
    parse_mesh,
)


def test_keys_are_the_apis_names_in_any_order() -> None:
    spec = parse_mesh(" TP=4, cp=2 ,rank_offset=16,pp=3")
    assert (spec.tp, spec.pp, spec.cp, spec.dp, spec.rank_offset) == (4, 3, 2, 1, 16)
    assert spec.size == 24
    assert parse_mesh("dp=2").rank_offset is None  # the tool places it
    mesh = spec.mesh(name="student")
    assert (mesh.tp, mesh.cp, mesh.dp, mesh.pp, mesh.rank_offset) == (4, 2, 1, 3, 16)
    assert parse_mesh("tp=2").mesh(rank_offset=8).rank_offset == 8  # a default, not an override
    assert spec.mesh(rank_offset=8).rank_offset == 16


@pytest.mark.parametrize(
    "text", ["tp=8,pp=2,cp=1,dp=1,rank_offset=16", "tp=3", "dp=4,cp=2,rank_offset=0"]
)
def test_str_reads_back(text: str) -> None:
    spec = parse_mesh(text)
    assert parse_mesh(str(spec)) == spec
    assert str(parse_mesh("pp=2,tp=8,rank_offset=16")) == "tp=8,pp=2,cp=1,dp=1,rank_offset=16"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=2,abc", "mesh 'tp=2,abc': 'abc' is not KEY=VALUE (write e.g. tp=8,pp=2,"),
        ("tp=2,offset=4", "offset= is now rank_offset="),
        ("tp=2,at=4", "at= is now rank_offset="),
        ("tp=2,ep=4", "unknown key 'ep' (keys: tp, pp, cp, dp, rank_offset)"),
        ("tp=2,tp=4", "tp= given twice"),
        ("tp=two", "tp='two' is not an integer"),
        ("tp=2.5", "tp='2.5' is not an integer"),
        ("tp=0", "tp=0 must be >= 1"),
        ("rank_offset=-1", "rank_offset=-1 must be >= 0"),
        (" , ", "empty mesh"),
    ],
)
def test_errors_are_one_line_naming_the_token(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_mesh(text)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)
    assert "invalid literal" not in str(exc.value)  # no raw int() error


def test_spec_checks_its_own_fields() -> None:
    with pytest.raises(ValueError, match="tp must be a positive int"):
        MeshSpec(tp=0)
    with pytest.raises(ValueError, match="rank_offset must be a non-negative int"):
        MeshSpec(rank_offset=-2)


def test_int_lists() -> None:
    assert parse_int_list("64, 96,") == (64, 96)
    with pytest.raises(ValueError, match=r"^hidden size 'abc' in '64,abc' is not an integer$"):
        parse_int_list("64,abc", what="hidden size")
    with pytest.raises(ValueError, match="hidden size 0 in '64,0' must be >= 1"):
        parse_int_list("64,0", what="hidden size")
    with pytest.raises(ValueError, match="empty list"):
        parse_int_list(" , ")
    assert parse_int_list("-3,0", minimum=None) == (-3, 0)


def test_parser_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    p = OneLineParser(prog="mopd x")
    p.add_argument("--teacher", type=mesh_type, required=True)
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("go").add_argument("--n", type=int)
    for argv, message in (
        (["--teacher", "tp=2,abc"], "argument --teacher: mesh 'tp=2,abc': 'abc' is not KEY=VALUE"),
        ([], "the following arguments are required: --teacher"),
        (["--teacher", "tp=2", "go", "--n", "x"], "argument --n: invalid int value: 'x'"),
    ):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert "usage:" not in err
    assert isinstance(p.parse_args(["--teacher", "dp=2"]).teacher, MeshSpec)
    assert issubclass(OneLineParser, argparse.ArgumentParser)
