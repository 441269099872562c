"""The `k3 train` flags, shared by `k3 train` and `python -m openk3.train` (the torchrun entry point), derived from
TrainConfig's fields: every field made with `config.flag(...)` is a flag --field-name, with the field's type, help and
choices. A flag left out keeps the default, or on --resume the value the run started with (except the fields marked
`launch`, which belong to this launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from openk3.train.config import TrainConfig

# Changing these on --resume is the point of resuming (or cannot differ), so it prints no note.
_QUIET_ON_RESUME = ("steps", "resume", "out")


def _flag_fields(cls=TrainConfig) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _field_type(name: str, cls=TrainConfig) -> type:
    """The field's annotated type, without `| None`."""
    t = typing.get_type_hints(cls)[name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def add_train_arguments(p: argparse.ArgumentParser, cls=TrainConfig) -> None:
    """The flags of `cls` (TrainConfig, or another config dataclass made with `config.flag`, e.g. `k3 rl`'s)."""
    for f in _flag_fields(cls):
        name, meta, typ = f.name.replace("_", "-"), f.metadata, _field_type(f.name, cls)
        if typ is bool and f.default:
            p.add_argument(f"--no-{name}", dest=f.name, action="store_const", const=False, default=None,
                           help=meta["help"])  # fmt: skip
            if meta.get("both"):  # a switch on by default that a command line may also name explicitly
                p.add_argument(f"--{name}", dest=f.name, action="store_const", const=True, default=None,
                               help=argparse.SUPPRESS)  # fmt: skip
        elif typ is bool:
            p.add_argument(f"--{name}", dest=f.name, action="store_const", const=True, default=None, help=meta["help"])
        else:
            # Choices are shown as the metavar and checked by TrainConfig.validate (a ValueError naming the value).
            metavar = "{" + ",".join(meta["choices"]) + "}" if "choices" in meta else None
            # The parser's default is None ("not given": on --resume the run's value applies), so --help shows the
            # field's default in the text.
            shown = f.default is not None and not meta.get("required", False)
            help_text = f"{meta['help']} (default: {f.default})" if shown else meta["help"]
            p.add_argument(f"--{name}", dest=f.name, type=typ, default=None, required=meta.get("required", False),
                           metavar=metavar, help=help_text)  # fmt: skip


def config_from_args(args, cls=TrainConfig, file_name: str = "train_config.json", command: str = "k3 train"):
    """The run's config: the given flags over the defaults, or on --resume over the saved `file_name`."""
    fields = _flag_fields(cls)
    given = {f.name: getattr(args, f.name) for f in fields if getattr(args, f.name) is not None}
    saved_file = os.path.join(args.out, file_name)
    if not (args.resume and os.path.exists(saved_file)):
        return cls(**given)
    saved = dataclasses.asdict(cls.from_file(saved_file))
    launch = {f.name: f.default for f in fields if f.metadata.get("launch")}
    for key, value in given.items():
        if key not in launch and key not in _QUIET_ON_RESUME and saved.get(key) != value:
            print(f"{command}: note: --resume changes {key} from {saved.get(key)!r} to {value!r}", file=sys.stderr)
    saved.update(launch)
    saved.update(given)
    return cls(**saved)
