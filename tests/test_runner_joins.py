"""runner/joins.py: which joining prompts' tokens ride a group's next decode step, and the block they make."""
import numpy as np

from opt_serving.runner.joins import Joining, Joins, block_sizes
from opt_serving.runner.types import JOIN_PROMPTS, SlotSettings

S = SlotSettings()


def ragged(budget=32, rows=8, width=63):
    return Joins(groups=1, rows=rows, sizes=block_sizes(budget), ragged=True, longest=32, width=width, pad=1)


def prompt(slot, n, row=None):
    return Joining(slot, slot if row is None else row, [2] + [5 + slot] * (n - 1), S)


def spans(parts):
    return [(p.joining.slot, p.start, p.end) for p in parts]


def test_block_sizes_are_powers_of_two_and_halfway_up_to_the_budget():
    assert block_sizes(256) == (8, 16, 32, 48, 64, 96, 128, 192, 256)
    assert block_sizes(100) == (8, 16, 32, 48, 64, 96, 100)
    assert block_sizes(8) == (8,)


def test_the_oldest_prompt_takes_the_budget_and_the_next_the_rest():
    j = ragged(budget=32)
    for slot, n in ((0, 20), (1, 26), (2, 48)):
        assert j.add(0, prompt(slot, n))
    assert spans(j.take(0)) == [(0, 0, 20), (1, 0, 12)]
    assert spans(j.take(0)) == [(1, 12, 26), (2, 0, 18)]
    assert spans(j.take(0)) == [(2, 18, 48)]  # 30 tokens: a block of 32 pads 2
    assert not j.waiting(0) and j.take(0) == []


def test_prompts_that_finish_within_a_quarter_of_the_budget_go_first_up_to_half_of_it():
    j = ragged(budget=32)
    assert j.add(0, prompt(0, 60))
    for slot in (1, 2, 3):  # 6, 6 and 8 tokens: each within 8, but only 16 of them go first
        assert j.add(0, prompt(slot, 6 if slot < 3 else 8))
    assert spans(j.take(0)) == [(1, 0, 6), (2, 0, 6), (0, 0, 20)]  # then the oldest takes what is left
    assert spans(j.take(0)) == [(3, 0, 8), (0, 20, 44)]


def test_a_step_gives_at_most_join_prompts_their_first_tokens():
    j = ragged(budget=512, rows=40)
    for slot in range(JOIN_PROMPTS + 3):
        assert j.add(0, prompt(slot, 4))
    assert len(j.take(0)) == JOIN_PROMPTS and len(j.take(0)) == 3


def test_a_deferred_prompt_waits_without_holding_up_the_others():
    j = ragged(budget=32)
    first, waiting, other = prompt(0, 20), prompt(1, 16), prompt(2, 10)
    waiting.deferred = True
    for p in (first, waiting, other):
        assert j.add(0, p)
    assert spans(j.take(0)) == [(0, 0, 20), (2, 0, 10)]  # the one behind it goes on
    waiting.deferred = False
    assert spans(j.take(0)) == [(1, 0, 16)]


def test_a_step_carries_the_block_below_its_tokens_when_that_leaves_fewer_than_the_block_above_pads():
    j = ragged(budget=32)  # blocks of 8, 16 and 32
    assert j.add(0, prompt(0, 20))  # 16 would leave 4 where 32 pads 12
    assert spans(j.take(0)) == [(0, 0, 16)] and spans(j.take(0)) == [(0, 16, 20)]
    assert j.add(0, prompt(5, 20))  # no row running: the 4 tokens left would cost a step of their own
    assert spans(j.take(0, rows_running=False)) == [(5, 0, 20)]
    assert j.add(0, prompt(1, 28))  # 32 pads 4 where 16 would leave 12
    assert spans(j.take(0)) == [(1, 0, 28)]
    for slot in (2, 3, 4):  # 18 tokens of short prompts: 16 would leave one of them for the next step
        assert j.add(0, prompt(slot, 6))
    assert spans(j.take(0)) == [(2, 0, 6), (3, 0, 6), (4, 0, 6)]
    j = ragged(budget=512, rows=40, width=511)
    assert j.add(0, prompt(0, 300)) and j.add(0, prompt(1, 10))  # 310: 384 pads 74, 256 leaves 54
    first = j.take(0)
    assert spans(first) == [(1, 0, 10), (0, 0, 246)] and j.block(first).ids.shape == (256,)
    assert spans(j.take(0)) == [(0, 246, 294)]  # 54 tokens: 48 leaves 6 where 64 pads 10
    assert spans(j.take(0)) == [(0, 294, 300)]


def test_a_prompt_asking_for_its_scores_never_joins_and_without_ragged_steps_only_short_ones_whole():
    j = ragged()
    assert not j.add(0, Joining(0, 0, [2, 3], SlotSettings(prompt_logprobs=True)))
    assert j.add(0, prompt(1, 63)) and not j.add(0, prompt(2, 64))  # at most `width` (the context less one)
    whole = Joins(groups=1, rows=8, sizes=(8, 16), ragged=False, longest=16, width=16, pad=1)
    assert not whole.add(0, prompt(0, 17))
    assert whole.add(0, prompt(0, 10)) and not whole.add(0, prompt(1, 7))  # 17 would not fit the largest block
    assert whole.add(0, prompt(1, 6)) and spans(whole.take(0)) == [(0, 0, 10), (1, 0, 6)]


def test_the_block_lays_parts_out_at_their_entries_and_gives_the_sampler_whole_prompts():
    j = ragged(budget=32)
    a, b = prompt(0, 20, row=3), prompt(1, 26, row=5)
    a.done = a.cached = 16  # a cached prefix: its part starts at entry 16
    j.add(0, a)
    j.add(0, b)
    parts = j.take(0)
    assert spans(parts) == [(0, 16, 20), (1, 0, 28 - 2)]  # 4 + 26 tokens: both finish
    block = j.block(parts)
    assert len(block.ids) == 32 and block.ids[:4].tolist() == a.tokens[16:]
    assert block.rows.tolist() == [3] * 4 + [5] * 26 + [8] * 2  # padding: past the group's rows
    assert block.entries[:6].tolist() == [16, 17, 18, 19, 0, 1]
    assert block.last[:2].tolist() == [3, 29] and block.last_rows[:3].tolist() == [3, 5, 8]
    assert block.lengths[:2].tolist() == [20, 26] and block.prompts[0, :20].tolist() == a.tokens
    assert block.settings == (S, S) and np.all(block.mask[1, 26:] == 0)


def test_running_rows_ride_in_the_block_and_count_against_its_budget():
    """A packed step (runner.types.PackedTokens): the running rows' tokens and the prompts' share the block and the
    budget; the block rule pads the whole."""
    j = ragged(budget=32)
    assert j.add(0, prompt(0, 40))
    assert spans(j.take(0, decoding=4)) == [(0, 0, 28)]  # 4 + 28 = 32: the budget
    assert spans(j.take(0, decoding=3)) == [(0, 28, 40)]  # 3 + 12 = 15 fill less than a block of 16
    assert j.add(0, prompt(1, 20))
    # 3 + 20 = 23 tokens: a block of 32 would pad 9, one of 16 leaves 7 for the next step
    assert spans(j.take(0, decoding=3)) == [(1, 0, 13)]
    assert spans(j.take(0, decoding=3)) == [(1, 13, 18)]  # 3 + 7 = 10: a block of 8 leaves 2, one of 16 pads 6
    assert spans(j.take(0, decoding=3)) == [(1, 18, 20)]


def test_a_budget_below_the_block_holds_the_rows_and_a_few_prompt_tokens():
    """The block sizes may go past the prompt budget (every running row and 8 prompt tokens); the prompts keep to it."""
    j = Joins(groups=1, rows=16, sizes=block_sizes(24), ragged=True, longest=32, width=63, pad=1, budget=8)
    assert j.budget == 8 and j.sizes[-1] == 24
    assert j.add(0, prompt(0, 30))
    assert spans(j.take(0, rows_running=False)) == [(0, 0, 8)]
    assert spans(j.take(0, decoding=16)) == [(0, 8, 16)]  # 16 rows and the budget's 8 fill the block of 24
    assert spans(j.take(0, decoding=20)) == [(0, 16, 20)]  # 20 rows leave room for 4
