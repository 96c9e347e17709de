"""The closed binding vocabulary and process roles."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from cacheon_core import BindingError, BindingVocabulary, Role, current_role, mark_role
from cacheon_core._roles import gate_name

VOCAB = BindingVocabulary({"arfusion", "attention_decode", "msa_prefill", "norm_rmsnorm", "resident_swap"})
names = st.sampled_from(sorted(VOCAB.bindings))


@given(st.lists(names, unique=True), st.randoms())
def test_normalize_sorts_any_order_of_a_valid_set(selected, rnd):
    shuffled = list(selected)
    rnd.shuffle(shuffled)
    assert VOCAB.normalize(shuffled) == tuple(sorted(selected))


@given(st.lists(names, min_size=1, unique=True), st.data())
def test_duplicates_are_rejected(selected, data):
    dup = data.draw(st.sampled_from(selected))
    with pytest.raises(BindingError, match=f"{dup!r} is selected more than once"):
        VOCAB.normalize([*selected, dup])


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=20))
def test_unknown_names_are_rejected(name):
    assume(name not in VOCAB.bindings)
    with pytest.raises(BindingError):
        VOCAB.normalize([name])


@given(names, st.sampled_from([str.upper, lambda s: " " + s, lambda s: s + "\n", lambda s: s.replace("_", "-")]))
def test_non_canonical_spellings_are_rejected(name, spoil):
    bad = spoil(name)
    assume(bad != name)
    with pytest.raises(BindingError, match="not canonical"):
        VOCAB.normalize([bad])


@given(st.lists(names, unique=True))
def test_wire_form_must_already_be_canonical(selected):
    canonical = ",".join(sorted(selected))
    assert VOCAB.parse(canonical) == tuple(sorted(selected))
    if len(selected) > 1 and selected != sorted(selected):
        with pytest.raises(BindingError, match="is not canonical: expected"):
            VOCAB.parse(",".join(selected))


@given(st.lists(names, unique=True), st.dictionaries(names, st.sampled_from(["1", "0", "yes", ""])))
def test_launch_environment_emits_every_gate_and_overrides_stale_values(selected, ambient_raw):
    ambient = {gate_name(k): v for k, v in ambient_raw.items()}
    env = {**ambient, **VOCAB.launch_environment(selected)}
    assert set(VOCAB.launch_environment(selected)) == set(VOCAB.gates.values())
    assert VOCAB.armed(env) == tuple(sorted(selected))


def test_armed_refuses_a_partial_or_garbled_environment():
    env = VOCAB.launch_environment(["arfusion"])
    del env[gate_name("norm_rmsnorm")]
    with pytest.raises(BindingError, match="CACHEON_BIND_NORM_RMSNORM=None"):
        VOCAB.armed(env)
    env = VOCAB.launch_environment([]) | {gate_name("arfusion"): "true"}
    with pytest.raises(BindingError, match="CACHEON_BIND_ARFUSION='true'"):
        VOCAB.armed(env)


def test_vocabulary_itself_must_be_canonical():
    with pytest.raises(BindingError, match="'Norm' is not canonical"):
        BindingVocabulary({"Norm"})


def test_roles_are_process_local_and_a_scheduler_stays_one():
    import cacheon_core._roles as roles

    before = roles._role
    try:
        roles._role = Role.OTHER
        mark_role(Role.DRIVER)
        assert current_role() is Role.DRIVER
        mark_role(Role.SCHEDULER)
        with pytest.raises(RuntimeError, match="cannot become other"):
            mark_role(Role.OTHER)
    finally:
        roles._role = before
