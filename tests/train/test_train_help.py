"""`--help` shows defaults: the train flags' from TrainConfig (their parser default is None, "not given"), the other
subcommands' from argparse, never "(default: None)" or a switch's False."""

from openk3.cli import build_parser


def _help(*argv):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    return " ".join(sub.format_help().split())  # one line: wrapping may split "(default: X)"


def test_help_shows_defaults_and_choices():
    text = _help("train")
    for shown in ("model preset (default: tiny)", "(default: 200)", "--balance {quantile,sign,none}",
                  "(default: quantile)", "(default: 0.003)", "(default: 100)"):  # fmt: skip
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: runs/tiny)" not in text  # --out is required: no default to show
    init = _help("init")
    assert "--preset {k3,medium,small,tiny} (default: tiny)" in init and "--seed SEED (default: 0)" in init
    assert "(default: None)" not in init
