"""The one rule per kind of value (commlib.settings): what every reader of a user's value refuses."""

import pytest

from commlib import settings

pytestmark = pytest.mark.contract


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e400", 10**400, "abc", ""])
def test_a_number_is_finite_and_a_number(raw):
    with pytest.raises(ValueError, match=r"expected X to be a finite number.*found"):
        settings.number(raw, "X")


def test_a_number_within_its_bounds():
    assert settings.number("2.5", "X", low=0, high=3) == 2.5
    with pytest.raises(ValueError, match=r"expected T to be a finite number of seconds in \[0, 3\] and > 0; "
                                         r"found '0'"):
        settings.number("0", "T", low=0, high=3, above=0, unit="seconds")
    with pytest.raises(ValueError, match=r"<= 10; found 11"):
        settings.number(11, "X", high=10)
    with pytest.raises(TypeError, match="found bool True"):
        settings.number(True, "X")


@pytest.mark.parametrize("raw", ["3.5", "1e3", "9" * 400, "", " ", "0x10"])
def test_an_integer_is_decimal_text_or_an_int(raw):
    with pytest.raises(ValueError, match=r"expected N to be an integer"):
        settings.integer(raw, "N")


def test_an_integer_within_its_bounds():
    assert settings.integer(" 7 ", "N", low=0, high=10) == 7
    assert settings.integer(-3, "N") == -3
    with pytest.raises(ValueError, match=r"expected N to be an integer in \[1, 10\]; found 10000000000"):
        settings.integer(10**10, "N", low=1, high=10)
    for bad in (3.0, True):
        with pytest.raises(TypeError):
            settings.integer(bad, "N")


def test_the_environment_reads_empty_as_unset():
    env = {"A": "", "B": "5", "C": "yes", "D": "gloo", "E": "x"}
    assert settings.env_number("A", 1.5, environ=env) == 1.5
    assert settings.env_integer("B", 0, environ=env, low=0) == 5
    assert settings.env_flag("C", environ=env) is True
    assert settings.env_flag("A", True, environ=env) is True
    assert settings.env_choice("D", ("gloo", "nccl"), "nccl", environ=env) == "gloo"
    with pytest.raises(ValueError, match=r"expected E to be one of \['gloo', 'nccl'\]; found 'x'"):
        settings.env_choice("E", ("gloo", "nccl"), "gloo", environ=env)
    with pytest.raises(ValueError, match="expected E to be 1 or 0"):
        settings.env_flag("E", environ=env)


def test_text_is_one_non_empty_printable_line():
    assert settings.text("debug", "partition") == "debug"
    assert settings.text("--comment=a b", "arg", spaces=True) == "--comment=a b"
    for bad in ("", "a\nb", "a\tb", "a\x00b", "a b", "x" * 1025):
        with pytest.raises(ValueError, match="expected partition to be a non-empty line of at most 1024 printable"):
            settings.text(bad, "partition")
    with pytest.raises(ValueError, match="found 'a\\\\nb'"):
        settings.text("a\nb", "arg", spaces=True)
    with pytest.raises(TypeError, match="found int 7"):
        settings.text(7, "partition")
