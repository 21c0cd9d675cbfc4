"""The services' settings as `kvmesh up` sees them: which it takes, what it forwards to each
process, what a repository entry's `[serving]` may set for its own pair, and the check that
every process's configuration builds from them before any process starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping

from services.engine_worker import config as worker_config
from services.gateway import config as gateway_config
from services.scheduler import config as scheduler_config
from shared.errors import KvmeshError
from shared.model_entry import ENTRY_FILE, ModelEntry, ServingConfig
from shared.model_paths import resolve_model_path
from shared.model_repository import ModelRepository
from shared.runtime.settings import (
    GATEWAY,
    SCHEDULER,
    WORKER,
    Setting,
    SettingError,
    forwarded_args,
)


def _taken(groups: Iterable[Iterable[Setting]]) -> tuple[Setting, ...]:
    """The settings with a taker, each once (the step limits are both the worker's and the
    scheduler's)."""
    seen: dict[str, Setting] = {}
    for settings in groups:
        for setting in settings:
            if setting.takers:
                seen.setdefault(setting.flag, setting)
    return tuple(seen.values())


UP_SETTINGS = _taken((worker_config.SETTINGS, scheduler_config.SETTINGS, gateway_config.SETTINGS))
PER_MODEL = {s.dest: s for s in UP_SETTINGS if s.per_model}
PARSERS = {
    WORKER: worker_config.build_parser,
    SCHEDULER: scheduler_config.build_parser,
    GATEWAY: gateway_config.build_parser,
}


def service_args(args: argparse.Namespace, taker: str) -> list[str]:
    """What `kvmesh up` forwards to every process of one kind; --kv-redis only when given (the
    launcher names the mesh's own Redis otherwise)."""
    forwarded = forwarded_args(args, UP_SETTINGS, taker)
    if taker == WORKER and args.kv_redis:
        forwarded += ["--kv-redis", args.kv_redis]
    return forwarded


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """The settings a model's entry may set, as flags of `kvmesh models add` (unset: the
    mesh's own value)."""
    group = parser.add_argument_group("serving config (the entry's [serving])")
    for setting in PER_MODEL.values():
        group.add_argument(
            f"--{setting.flag}",
            type=setting.check,
            choices=setting.choices or None,
            help=setting.help,
        )


def serving_of(args: argparse.Namespace) -> ServingConfig:
    return ServingConfig(
        {dest: getattr(args, dest) for dest in PER_MODEL if getattr(args, dest) is not None}
    )


def checked_serving(serving: Mapping[str, object], where: str) -> dict[str, object]:
    """The table's values parsed as their flags would be; a key no model may set, or a value
    its flag refuses, raises SettingError naming the file, the key and the value."""
    checked = {}
    for key, value in serving.items():
        setting = PER_MODEL.get(key)
        if setting is None:
            allowed = ", ".join(sorted(PER_MODEL))
            raise SettingError(f"{where}: [serving] {key}: not a setting a model sets ({allowed})")
        try:
            checked[key] = setting.check(str(value))
        except argparse.ArgumentTypeError as error:
            raise SettingError(f"{where}: [serving] {key} = {value!r}: {error}") from None
    return checked


def serving_args(entry: ModelEntry, taker: str) -> list[str]:
    """An entry's [serving] values for one process of its pair, as arguments."""
    where = os.path.join(entry.directory, ENTRY_FILE)
    values = checked_serving(entry.serving, where)
    return [
        part
        for key, value in values.items()
        if taker in PER_MODEL[key].takers
        for part in PER_MODEL[key].as_args(value)
    ]


def _refusal(where: str, message: str) -> SettingError:
    return SettingError(f"{where}: {message}" if where else message)


def _parse(taker: str, argv: list[str], where: str) -> argparse.Namespace:
    try:
        return PARSERS[taker]().parse_args(argv)
    except SettingError as error:
        raise _refusal(where, str(error).partition("error: ")[2]) from None


def check_pair(worker_argv: list[str], scheduler_argv: list[str], where: str) -> None:
    """Build the pair's configurations as its processes will, from the arguments they will get:
    a value that only fails beside another (--quantize with --weights float32, the redis tier
    with no URL) is refused here, before anything starts."""
    worker = _parse(WORKER, worker_argv, where)
    scheduler = _parse(SCHEDULER, scheduler_argv, where)
    try:
        worker_config.engine_config(worker)
        scheduler_config.scheduler_config(scheduler)
        scheduler_config.handover_config(scheduler, "worker:0")
    except KvmeshError as error:
        raise _refusal(where, error.message) from None
    if worker.kv_disk_dir and "disk" in worker.kv_tiers.split(","):
        try:  # the worker creates it too: here a bad path costs no start
            os.makedirs(worker.kv_disk_dir, exist_ok=True)
        except OSError as error:
            message = f"--kv-disk-dir {worker.kv_disk_dir!r}: {error.strerror}"
            raise _refusal(where, message) from None


def refused(args: argparse.Namespace, models: list[str]) -> str | None:
    """Why these flags (and the entries of `models`) cannot start the mesh, or None."""
    worker_args = [*service_args(args, WORKER), "--kv-redis", args.kv_redis or "redis://mesh"]
    scheduler_args = service_args(args, SCHEDULER)
    try:
        _parse(GATEWAY, service_args(args, GATEWAY), "")
        if not models:
            if args.model:
                resolve_model_path(args.model)
            check_pair(worker_args, scheduler_args, "")
        repository = ModelRepository(args.model_repo or "models")
        for spec in models:
            entry = repository.resolve(spec)
            check_pair(
                [*worker_args, *serving_args(entry, WORKER)],
                [*scheduler_args, *serving_args(entry, SCHEDULER)],
                entry.label,
            )
    except SettingError as error:
        return str(error)
    except KvmeshError as error:
        return error.message
    return None
