"""`esbatch validate` on random documents: every outcome is ok (0) or a clear error (2), never a traceback.

Documents mix real keys (so the fuzzer reaches deep into each schema) with junk, and every YAML type."""

import dataclasses

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esbatch.cli import main
from esbatch.config.launcher import LauncherProfile
from esbatch.config.run import Config as TrainConfig
from esbatch.config.sweep import SweepFile


def _keys(cls) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        out.append(f.name)
        if dataclasses.is_dataclass(f.type) or (
            isinstance(f.type, str) and f.default_factory is not dataclasses.MISSING
        ):
            try:
                out += [f"{f.name}.{k}" for k in _keys(type(f.default_factory()))]
            except TypeError:
                pass
    return out


KEYS = sorted(set(_keys(TrainConfig) + _keys(SweepFile) + _keys(LauncherProfile) + ["grid", "zip", "tasks", "ks"]))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["es", "grpo", "pipeline", "toy:DigitTask", "os:system", "1e-3", "..", "a\nb", "quickstart"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), inner, max_size=4),
    ),
    max_leaves=12,
)


def nest(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        node = out
        parts = str(k).split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[parts[-1]] = v
    return out


documents = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=8).map(nest),
    values,
    st.builds(
        lambda d: {"name": "fz", "base": "quickstart", **d}, st.dictionaries(st.sampled_from(KEYS), values, max_size=4)
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents, kind=st.sampled_from([None, "config", "sweep", "launcher", "eval"]))
def test_validate_never_raises(tmp_path_factory, capsys, doc, kind):
    f = tmp_path_factory.mktemp("fz") / "doc.yaml"
    f.write_text(yaml.safe_dump(doc, allow_unicode=True))
    code = main(["validate", *(["--kind", kind] if kind else []), str(f)])
    out = capsys.readouterr()
    assert code in (0, 2), out
    assert "Traceback" not in out.err
