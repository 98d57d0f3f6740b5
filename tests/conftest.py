"""Shared fixtures: synthetic checkpoints are generated once per test session."""

import pytest


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """synthetic_dir(checkpoint_id) -> Hugging Face folder of that synthetic checkpoint."""
    from kipp.synthetic import synthesize

    made = {}

    def make(checkpoint_id):
        if checkpoint_id not in made:
            out = tmp_path_factory.mktemp(checkpoint_id.replace("/", "--"))
            made[checkpoint_id] = synthesize(checkpoint_id, out)
        return made[checkpoint_id]

    return make


@pytest.fixture(scope="session")
def tiny_dir(synthetic_dir):
    return synthetic_dir("kipp-synthetic/qwen3-tiny")
