"""The README and the docs site stay true: every command the README and the docs show names a
real make target, `kvmesh` subcommand and flags, or HTTP route; every page is in the site's
navigation; every benchmark target is documented; the generated reference covers the code."""

from __future__ import annotations

import importlib
import pathlib
import re
import shlex
from types import SimpleNamespace

import pytest
import yaml

from kvmesh.cli import DELEGATED, build_parser
from kvmesh.reference_docs import section, subcommands
from shared.runtime.settings import SettingError

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_README_LINES = 200


def _shell_commands(markdown: str) -> list[str]:
    """Lines of the shell blocks that start with make, kvmesh or curl (continuations joined,
    comments dropped)."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", markdown, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if re.match(r"(\.venv/bin/)?(make|kvmesh|curl)\b", line):
                commands.append(line)
    return commands


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"(?m)^([a-z][a-z0-9-]*):", makefile))


def _http_routes() -> list[tuple[str, re.Pattern[str]]]:
    from services.gateway.openai_front.server import OpenAIFront
    from services.gateway.policy.policy import GatewayPolicy

    front = OpenAIFront(SimpleNamespace(policy=GatewayPolicy()), None)
    routes = []
    for route in front.app().router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        pattern = re.compile(re.sub(r"\{[^}]+\}", "[^/]+", path) + "$")
        routes.append((route.method, pattern))
    return routes


def _check_command(words: list[str]) -> None:
    program = words[0].rsplit("/", 1)[-1]
    if program == "make":
        unknown = [w for w in words[1:] if "=" not in w and w not in _make_targets()]
        assert not unknown, f"no make target {unknown}"
    elif program == "kvmesh":
        parser, args = build_parser(), words[1:]
        if args[:1] and args[0] in DELEGATED:  # parsed by the module the command runs
            parser, args = importlib.import_module(DELEGATED[args[0]]).build_parser(), args[1:]
        try:
            parser.parse_args(args)
        except (SystemExit, SettingError) as stop:
            raise AssertionError(f"kvmesh does not take: {' '.join(words)}") from stop
    else:  # curl: the route and method must be the HTTP front's
        url = next(w for w in words[1:] if re.match(r"(https?://)?[\w.]+:\d+/", w))
        path = "/" + url.split("://")[-1].split("/", 1)[1]
        method = "POST" if any(w in ("-d", "--data", "-X") for w in words) else "GET"
        assert any(m == method and p.match(path) for m, p in _http_routes()), f"{method} {path}"


def test_the_readme_stays_short() -> None:
    assert len(README.splitlines()) <= MAX_README_LINES


def test_the_readme_opens_with_the_two_commands() -> None:
    first_block = _shell_commands(README)[:2]
    assert [c.split("#")[0].strip() for c in first_block] == ["make demo", "make test"]


def test_every_readme_command_is_real() -> None:
    commands = _shell_commands(README)
    assert len(commands) >= 6  # the two set-up commands, kvmesh up/generate/chat/trace, curl
    for command in commands:
        _check_command(shlex.split(command, comments=True))


def test_every_command_in_the_docs_is_real() -> None:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    commands = [(p, c) for p in pages for c in _shell_commands(p.read_text(encoding="utf-8"))]
    assert len(commands) >= 30
    for page, command in commands:
        try:
            _check_command(shlex.split(command, comments=True))
        except AssertionError as error:
            raise AssertionError(f"{page.relative_to(ROOT)}: {error}") from None


def test_the_command_check_catches_what_does_not_exist() -> None:  # could not pass vacuously
    for wrong in (
        "make nonexistent-target",
        "kvmesh launch",
        "kvmesh up --no-such-flag",
        "curl -s 127.0.0.1:8000/v1/nothing -d '{}'",
        "curl -s 127.0.0.1:8000/v1/chat/completions",  # a GET of a POST route
    ):
        with pytest.raises(AssertionError):
            _check_command(shlex.split(wrong))


def test_readme_links_point_at_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing


def _nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_docs_page_is_in_the_navigation_and_every_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    in_nav = _nav_pages(config["nav"])
    docs = ROOT / "docs"
    on_disk = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert on_disk - in_nav == set(), "pages missing from mkdocs.yml's nav"
    assert in_nav - on_disk == set(), "nav entries with no page"


def test_every_bench_target_is_documented() -> None:
    targets = {t for t in _make_targets() if t.startswith("bench-")}
    assert len(targets) >= 16
    for page in ("docs/benchmarks/index.md", "loadtest/README.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert {t for t in targets if f"make {t}`" not in text} == set(), page


def test_the_generated_reference_covers_the_code() -> None:
    from services.scheduler.metrics import GAUGES
    from shared.errors import Reason

    errors = section("errors")
    assert all(f"`{reason.value}`" in errors for reason in Reason)
    metrics = section("metrics")
    for name in ("kvmesh_requests_total", "kvmesh_step_duration_seconds", *GAUGES):
        assert f"`{name}`" in metrics
    cli = section("cli")
    assert all(f"`kvmesh {name}`" in cli for name in subcommands(build_parser()))
    flags = section("service-flags")
    assert "`--max-queue-ms` | `KVMESH_MAX_QUEUE_MS`" in flags and "## engine-worker" in flags
