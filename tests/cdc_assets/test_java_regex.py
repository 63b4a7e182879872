"""The tables file's Java regexes in Python: found where Java finds them, or refused.

Each expected verdict below is Java's (`Pattern.compile(java).matcher(subject).find()`), as
tests/checks/test_expectation_engines.py checks against the JVM for a wider set.
"""

from __future__ import annotations

import re

import pytest

from cdc_assets.java_regex import UntranslatableRegex, python_regex


@pytest.mark.parametrize(
    ("java", "subject", "found"),
    [
        # $ and \Z: the end, or before one final line terminator (any of Java's five).
        ("^[a-z]+$", "abc\n", True),
        ("^[a-z]+$", "abc\r", True),
        ("^[a-z]+$", "abc\r\n", True),
        ("^[a-z]+$", "abc\u2028", True),
        ("^[a-z]+$", "abc\n\n", False),
        (r"a\Z", "a\r", True),
        (r"a\z", "a\n", False),
        (r"a\z", "a", True),
        ("(?m)^b", "a\rb", True),
        ("(?m)^", "a\n", True),
        ("(?m)^$", "a\n", False),  # Java's multiline ^ never matches at the very end
        # . stops at every line terminator, unless (?s).
        ("^.$", "\r", False),
        ("^.$", "\u0085", False),
        ("(?s)^.$", "\r", True),
        ("^.$", "😀", True),  # one character, as in Java
        # \w, \d, \s and case folding are ASCII in Java.
        (r"^\w+$", "ünï", False),
        (r"\d", "٣", False),
        (r"\s", "\u3000", False),
        ("(?i)k", "\u212a", False),  # the Kelvin sign
        ("(?i)é", "É", False),
        ("(?i)abc", "aBC", True),
        # Inline flags last to the end of their group, across alternatives.
        ("a(?i)b|c", "C", True),
        ("((?i)a)b", "AB", False),
        ("(?i:a)b", "Ab", True),
        # POSIX classes, \h, \v, \R and \Q...\E.
        (r"^\p{Alpha}+$", "abcé", False),
        (r"^\p{Punct}$", "~", True),
        (r"\P{Alpha}", "abc", False),
        (r"[\p{Digit}x]", "x", True),
        (r"x\hy", "x\u00a0y", True),
        (r"\v", "\u2028", True),
        (r"^\R\n$", "\r\n", True),
        (r"\Qa.b\E", "axb", False),
        (r"x\Q*\E+", "x**", True),
        # Escapes Python spells otherwise.
        (r"\x{1F600}", "😀", True),
        (r"\0101", "A", True),
        (r"\cA", "\x01", True),
        (r"\e", "\x1b", True),
        # Named groups and references.
        (r"(?<year>\d{4})-\k<year>", "2020-2020", True),
        (r"(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)\10", "abcdefghijj", True),
        (r"(a)\11", "aa1", True),  # one group: \1, then a literal 1
        # Classes Java and Python both read alike once spelled out.
        ("[]a]", "]", True),
        ("[a-c-e]", "-", True),
        ("[^]a]", "]", False),
    ],
)
def test_a_translated_regex_finds_what_java_finds(java, subject, found):
    assert (re.search(python_regex(java), subject) is not None) is found


@pytest.mark.parametrize(
    ("java", "construct"),
    [
        (r"\bword\b", r"the word boundary \b"),
        (r"\p{L}+", r"\p{L}"),
        (r"\pL", r"\pL (a Unicode category)"),
        (r"\p{IsLatin}", r"\p{IsLatin}"),
        ("[a-z&&[^q]]", "a class intersection '&&'"),
        ("[a[b]]", "a class inside a class"),
        (r"[\P{Alpha}x]", r"\P inside a class"),
        (r"(?U)\w", "the inline flag 'U'"),
        ("(?x)a b", "the inline flag 'x'"),
        (r"\Gx", r"\G (the end of the previous match)"),
        (r"\uD83D\uDE00", "an escaped UTF-16 surrogate"),
        ("(?<=a+)b", "a construct Python can't compile"),
        (r"\2(a)", r"a reference \2 to a group not opened before it"),
        ("(?P<n>a)", "'(?P'"),  # Python's syntax, not Java's
        ("a{,2}", "a '{' that is not a quantifier"),
        ("(", "an unclosed group"),
        ("*a", "a quantifier '*' with nothing it can repeat"),
        (r"\y", r"the escape \y"),
    ],
)
def test_a_regex_without_a_faithful_python_form_is_refused_by_name(java, construct):
    with pytest.raises(UntranslatableRegex) as refused:
        python_regex(java)
    assert refused.value.construct.startswith(construct)
    assert refused.value.fix  # and says what to write instead


def test_the_demo_regexes_translate_to_ascii_patterns_that_compile_cleanly():
    for java in (r"^[^@\s]+@[^@\s]+\.[a-z]+$", "^SKU-[A-Z]{3}-[0-9]{4}$"):
        python = python_regex(java)
        assert python.startswith("(?a)")
        assert re.search(python, "SKU-ABC-1234") or re.search(python, "a@b.io")
