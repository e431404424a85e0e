"""frozen_heap: the objects alive when a run starts are skipped by garbage collections during it."""

import gc

import pytest

from treegen.runtime.host_gc import frozen_heap


def test_the_heap_is_frozen_inside_once_however_nested_and_given_back_after():
    assert gc.get_freeze_count() == 0
    before = [object() for _ in range(3)]  # noqa: F841 (alive at entry)
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # a nested run freezes nothing more
            made = [[] for _ in range(10)]  # noqa: F841
            assert 0 < gc.get_freeze_count() <= frozen  # (frozen objects may die; none are added)
        assert 0 < gc.get_freeze_count() <= frozen  # (frozen objects may die; none are added)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_caller_stays_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert 0 < gc.get_freeze_count() <= frozen  # (frozen objects may die; none are added)
    finally:
        gc.unfreeze()


def test_an_error_inside_gives_the_heap_back():
    with pytest.raises(ValueError), frozen_heap():
        raise ValueError("inside")
    assert gc.get_freeze_count() == 0


def test_garbage_alive_at_entry_is_collected_not_frozen():
    import weakref

    class Holder:  # (stands for an earlier run: a cycle holding memory)
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b  # unreachable, but a cycle: only a collection frees it
    with frozen_heap():
        assert gone() is None


def test_runs_in_two_threads_share_one_freeze_until_both_end():
    import threading

    inside, release = threading.Event(), threading.Event()

    def other_run():
        with frozen_heap():
            inside.set()
            release.wait(5)

    with frozen_heap():
        assert gc.get_freeze_count() > 0
        thread = threading.Thread(target=other_run)
        thread.start()
        assert inside.wait(5)
    assert gc.get_freeze_count() > 0  # the other thread's run is still open
    release.set()
    thread.join(5)
    assert gc.get_freeze_count() == 0
