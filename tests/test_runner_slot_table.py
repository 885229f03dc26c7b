"""The host's slot table (runner/slot_table.py): where each slot lives, and which slots a step's tokens still go to."""
import numpy as np

from opt_serving.runner.slot_table import SlotTable
from opt_serving.runner.types import SlotSettings


def test_consecutive_slots_alternate_groups():
    table = SlotTable(6, 2)
    assert [table.group_of(s) for s in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert table.group_slots(1).tolist() == [1, 3, 5]


def test_a_slot_freed_or_refilled_after_its_step_was_sent_takes_none_of_its_tokens():
    table = SlotTable(4, 1)
    for slot in range(3):
        table.insert(slot, 5, 7, SlotSettings())
    sent = np.flatnonzero(table.lengths > 0)
    generations = table.generation[sent]
    table.free(1)                           # freed while the step is out
    table.free(2)
    table.insert(2, 3, 9, SlotSettings())   # freed and refilled
    assert table.current(sent, generations).tolist() == [0]
    rows = np.zeros(4, np.bool_)
    rows[table.current(sent, generations)] = True
    table.advance(rows, np.array([11, 12, 13, 14], np.int32))
    assert table.next.tolist() == [11, 7, 9, 0] and table.lengths.tolist() == [6, 0, 3, 0]
