"""PackedOutputs: the workers' outputs as arrays. Lossless against the list form, concatenation maps prompt indices,
pickles without its cache, and the single-turn path builds the same batch from it as from lists."""

import pickle
import random

import numpy as np
import pytest
import torch

from stages.agent.loops import LoopContext, Sample, SingleTurnLoop
from stages.batch import build_batch
from stages.rollout.base import PackedOutputs, RolloutOutput, SamplingParams


def outputs(seed: int, count: int, prompts: int) -> list[RolloutOutput]:
    rng = random.Random(seed)
    outs = []
    for i in range(count):
        ids = [rng.randrange(150_000) for _ in range(rng.randrange(1, 30))]
        extra = {"versions": [3] * len(ids)} if i % 2 else {}
        outs.append(RolloutOutput(i % prompts, ids, [-rng.random() * 7 for _ in ids], rng.choice(["stop", "length"]),
                                  extra))
    return outs


def test_pack_round_trip_is_exact():
    outs = outputs(0, 12, 4)
    packed = PackedOutputs.pack(outs)
    assert packed[3] is outs[3]  # in this process: the given objects, not rebuilt from the arrays
    rebuilt = pickle.loads(pickle.dumps(packed))  # what the driver gets: made from the arrays
    assert len(rebuilt) == 12 and list(rebuilt) == outs  # the same Python ints and floats (float64 keeps them)
    assert rebuilt.token_lists() == [o.response_ids for o in outs]
    assert [a.tolist() for a in rebuilt.split(rebuilt.logprobs)] == [o.logprobs for o in outs]
    assert PackedOutputs.pack(packed) is packed


def test_pickle_sends_arrays_only_and_empty_outputs():
    packed = PackedOutputs.pack(outputs(1, 5, 5))
    list(packed)  # the cached RolloutOutput objects must not travel
    state = pickle.loads(pickle.dumps(packed)).__dict__
    assert state["_outputs"] is None and list(pickle.loads(pickle.dumps(packed))) == list(packed)
    empty = PackedOutputs.pack([])
    assert len(empty) == 0 and list(empty) == [] and empty.split(empty.token_ids) == []
    assert len(PackedOutputs.concat([], [])) == 0


def test_concat_maps_each_part_to_its_prompt_rows():
    a, b = outputs(2, 4, 2), outputs(3, 6, 3)
    rows_a, rows_b = [5, 1], [0, 4, 2]
    joined = PackedOutputs.concat([PackedOutputs.pack(a), b], [rows_a, rows_b])  # lists are packed too
    expected = [RolloutOutput(rows_a[o.prompt_index], o.response_ids, o.logprobs, o.finish_reason, o.extra) for o in a]
    expected += [RolloutOutput(rows_b[o.prompt_index], o.response_ids, o.logprobs, o.finish_reason, o.extra) for o in b]
    assert list(joined) == expected


def test_lengths_must_match_the_values():
    with pytest.raises(ValueError, match=r"sum\(lengths\)"):
        PackedOutputs(np.zeros(2), np.array([1, 2]), np.zeros(4), np.zeros(3), ["stop"] * 2, [{}] * 2)


class _Tok:
    backend_tokenizer = None
    clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_single_turn_batch_from_packed_equals_the_list_batch():
    outs = outputs(4, 8, 4)  # prompt-major: 2 per prompt
    outs.sort(key=lambda o: o.prompt_index)
    samples = [Sample(10 + i, [7] * (i + 2), [], {}) for i in range(4)]
    batches = []
    for given in (outs, pickle.loads(pickle.dumps(PackedOutputs.pack(outs)))):  # lists; arrays as workers send
        ctx = LoopContext(lambda ids, params, given=given: given, _Tok(), SamplingParams(n=2))
        trajectories = SingleTurnLoop().run_batch(ctx, samples)
        assert [t.text for t in trajectories] == [" ".join(map(str, o.response_ids)) for o in outs]
        assert [t.prompt_index for t in trajectories] == [10 + o.prompt_index for o in outs]
        assert [t.versions for t in trajectories] == [o.extra.get("versions") for o in outs]
        batches.append(build_batch([samples[t.prompt_index - 10].prompt_ids for t in trajectories],
                                   [t.response_ids for t in trajectories], [t.logprobs for t in trajectories], 0,
                                   response_masks=[t.response_mask for t in trajectories]))
    listed = build_batch([samples[o.prompt_index].prompt_ids for o in outs], [o.response_ids for o in outs],
                         [o.logprobs for o in outs], 0)
    for batch in batches:
        assert batch.tensors.keys() == listed.tensors.keys()
        for key, value in listed.tensors.items():
            assert torch.equal(batch.tensors[key], value), key
