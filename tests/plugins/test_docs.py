"""docs/plugins.md stays honest: every public member of every plugin contract, every group
and every outcome is documented there, and the guide points nowhere outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.platforms import Platform
from gateway.plugins import (
    ALL_GROUPS,
    BatchUpdate,
    EndpointPlugin,
    EngineClient,
    IOProcessor,
    LogitsProcessor,
    LoRAResolver,
    StatLoggerBase,
)
from gateway.plugins.records import OUTCOMES

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
CONTRACTS = (EndpointPlugin, EngineClient, StatLoggerBase, IOProcessor, LogitsProcessor,
             LoRAResolver, Platform)
# Members every Protocol or ABC has, which are not part of a contract.
_INHERITED = {"_abc_impl", "_is_protocol", "_is_runtime_protocol"}


def _sections() -> dict[str, str]:
    """'### Title' -> the text up to the next heading."""
    text = GUIDE.read_text()
    parts = re.split(r"^#{2,3} (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _public_members(cls: type) -> list[str]:
    names = set(getattr(cls, "__annotations__", {})) | set(vars(cls))
    public = {n for n in names if not n.startswith("_") and n not in _INHERITED}
    if "__init__" in vars(cls) and cls not in (EndpointPlugin, EngineClient):
        public.add("__init__")  # the constructor's arguments are part of the contract
    return sorted(public)


@pytest.mark.parametrize(("contract", "member"), [
    (cls, member) for cls in CONTRACTS for member in _public_members(cls)],
    ids=lambda value: getattr(value, "__name__", value))
def test_every_public_contract_member_is_documented_in_its_section(contract, member):
    section = _sections()[contract.__name__]
    assert f"`{member}" in section, f"{contract.__name__}.{member} is not in docs/plugins.md"


@pytest.mark.parametrize("field", BatchUpdate.__dataclass_fields__)
def test_every_batch_update_field_is_documented(field):
    assert f"`{field}`" in _sections()["LogitsProcessor"]


@pytest.mark.parametrize("group", ALL_GROUPS)
def test_every_group_has_a_section(group):
    assert group in _sections()


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_every_outcome_is_explained(outcome):
    assert f"| `{outcome}` |" in _sections()["Outcomes in /v1/plugins"]


def test_the_guide_has_the_sections_the_code_refers_to():
    referred = set()
    for path in (GUIDE.parents[1] / "gateway").rglob("*.py"):
        referred |= set(re.findall(r'docs/plugins\.md, ["\'](.+?)["\']', path.read_text()))
    assert referred and referred <= set(_sections())


def test_the_guide_points_nowhere_outside_the_repository():
    text = GUIDE.read_text()
    assert "../" not in text and "/work/" not in text and "DESIGN" not in text
