"""How a watchdog reports a watched block past its deadline: the overrun's protocol in the
job's store and the report's text (megatron/watchdog.py describes the whole design).

The store holds, under KEY_PREFIX: each rank's published check-ins (one key per rank and
group of ranks, `published_checkins`); per overrun of a block (its group, first check-in,
call number and deadline round), the count electing the one member that reads the
others' check-ins and the verdict it leaves for the rest (the report's first line, or
AGAIN when every member computes), and how many members are done with it (the last
removes the three keys, so overruns that recover do not pile up in the store; when a
member's block ended before its deadline, the first one done removes them once every
member has gone on to a later call of the block); each
member's collective counts for a block with `progress` (one key per name and rank,
overwritten); FIRED_KEY, counting the ranks whose report came (the first gives the full
report); ABORT_KEY, the first report's first line, which stops every other rank; SEEN_KEY,
counting the ranks that have printed their stop message (the last word of each, after a
report), which the ranks that wait before they exit look for.

`OverrunReports` is the part of `CollectiveWatchdog` that writes and reads these keys when
a block overruns; the watchdog itself keeps the check-ins, the monitor thread and the
stop of the process.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

KEY_PREFIX = "collective-watchdog"
ABORT_KEY = f"{KEY_PREFIX}/abort"  # the first line of the report of the rank that fired
FIRED_KEY = f"{KEY_PREFIX}/fired"  # how many ranks' deadlines passed: the first reports
SEEN_KEY = f"{KEY_PREFIX}/seen"  # how many ranks have printed their stop message
SETTLE_S = 0.2  # after publish_s: time for the other ranks' monitors to publish theirs
VERDICT_WAIT_S = 30.0  # a waiting member's wait for the report, beyond the reporter's own
AGAIN = "again"  # the verdict on an overrun where every member is computing
STACK_FRAMES = 4  # innermost frames of the main thread a report shows
EXCHANGE_S = 30.0  # an overrun block's wait for the other members' collective counts
FIRST_LOOK_S = 0.1  # the reporting member's first look for those counts; then twice as
MAX_LOOK_S = 1.0  # long each time, up to this (one request per look, whatever the group)
# sweep_overruns' looks at an overrun some members left before their deadline: then its
# few keys stay (a block that never runs again, or a member that never goes on to its
# next call, would have one rank read every member's check-ins each poll_s for good)
SWEEP_LOOKS = 12
# A block's `progress`: how many collectives this rank issued on its group (an int), or on
# each of several groups (`issued_collectives_on`); None when unknown.
Progress = Callable[[], Optional[Union[int, list]]]


class _Block:
    """A watched block: its deadline, its name (for the message), its check-ins --
    (point, this rank's count there, the ranks that must reach it) -- how many
    collectives this rank has issued on its group (see `watch`) and how many times its
    deadline has passed (`rounds`: it is moved on while every member has issued as many)."""

    __slots__ = ("deadline", "name", "points", "progress", "rounds")

    def __init__(self, deadline: float, name: str,
                 points: Tuple[Tuple[str, int, Tuple[int, ...]], ...],
                 progress: Optional[Progress]) -> None:
        self.deadline, self.name, self.points = deadline, name, points
        self.progress, self.rounds = progress, 0


class OverrunReports:
    """A `CollectiveWatchdog`'s overrun reports. Uses the watchdog's store, rank,
    timeout_s, publish_s, describe, announces, _counts (this rank's check-ins), _cond
    (guarding the blocks' deadlines), _fired, _reported_first (this rank left ABORT_KEY),
    _stopping (a reason to stop found while an overrun is examined), _left_overruns (for
    `sweep_overruns`), publish() and _still_in(block, seconds)."""

    def missing_ranks(self, name: str, count: int, ranks: Sequence[int],
                      read: Optional[dict] = None) -> List[int]:
        """Members of `ranks` that have reached `name` (checked in with `ranks`) fewer
        than `count` times, as published (`read`: the keys read so far, reused)."""
        ranks = tuple(ranks)
        return [r for r in ranks if self._reached(name, r, ranks, read) < count]

    def _reached(self, name: str, rank: int, ranks: Tuple[int, ...],
                 read: Optional[dict] = None) -> int:
        """How many times `rank` reached `name` (checked in with `ranks`): this rank's
        own count, else what that rank published."""
        if rank == self.rank:
            return self._counts.get(name, 0)
        read = {} if read is None else read
        if (rank, ranks) not in read:
            read[rank, ranks] = published_checkins(self.store, rank, ranks)
        return int(read[rank, ranks].get(name, 0))

    def _overrun_message(self, block: _Block) -> Optional[str]:
        """The report of `block`, past its deadline; None when there is none to give:
        the block ended or the watchdog closed while the other ranks' monitors were
        given time to publish, or every member is computing (the block gets another
        `timeout_s`). One member per overrun -- the first to count itself in the
        overrun's key, an atomic count in the store -- reads the others' check-ins and
        leaves its verdict there; the others wait for that verdict (one key each,
        however many ranks) instead of each reading every member's. Only the first
        rank to fire in the whole job (FIRED_KEY) gives the full report."""
        self.publish()
        # check-ins from before the deadline are all published after this wait
        if not self._still_in(block, self.publish_s + SETTLE_S):
            return None
        block.rounds += 1
        key = self._overrun_key(block)
        if self._count_in(f"{key}/reporter"):
            return self._report_overrun(block, key)
        verdict = self._await_verdict(block, key)
        if verdict is None:  # the block ended meanwhile: slow, not stuck
            self._done_with(block, key)
            return None
        if verdict == "":  # no verdict in time (the reporting rank died): report alone
            return self._report_overrun(block, key)
        if verdict == AGAIN:  # every member computing: not stuck yet
            self._done_with(block, key)
            with self._cond:
                block.deadline = time.monotonic() + self.timeout_s
            return None
        self._fired = True
        return self._second_report(block, _named_in(verdict))

    def _report_overrun(self, block: _Block, key: str) -> Optional[str]:
        """`_overrun_message` of the member that reads the others' check-ins; its verdict
        (the report's first line, or AGAIN) goes under `key`/verdict for the others."""
        report = self.overrun_report(block)
        if report is None and self._stopping is not None:  # another rank's report came
            return None
        if report is None:  # every member computing, none behind: not stuck yet
            self._leave(f"{key}/verdict", AGAIN)
            self._done_with(block, key)
            with self._cond:
                block.deadline = time.monotonic() + self.timeout_s
            return None
        message, named = report
        self._leave(f"{key}/verdict", message.splitlines()[0])
        self._fired, first = True, self._first_to_fire()
        if first:
            self._reported_first = True
            self._leave(ABORT_KEY, message.splitlines()[0])
            return message + "\n" + self.main_thread_stack()
        return self._second_report(block, named)

    def _second_report(self, block: _Block, named: List[int]) -> str:
        """The first line of the report on `block` naming `named`, of a rank whose report
        came after another's (which has the details); with where this rank's main
        thread is when it is the one stuck (the first report may name it in another
        block). "" for a rank that does not announce the lines every rank would print
        alike (`CollectiveWatchdog`'s `announces`). A rank stuck in `block` after the
        others left it (their collectives were asynchronous) finds none missing there;
        when the first report names it, it says so and quotes that report."""
        message = self._report_head(block, named) + " (another rank's watchdog reported it first)"
        if self.rank in named:
            return message + "\n" + self.main_thread_stack()
        first = self._abort_line()
        if self.rank in _named_in(first):  # the others waited for this rank elsewhere
            doing = self._doing()
            return (f"[watchdog rank {self.rank}] collective {block.name} did not complete "
                    f"within {self.timeout_s:g} s{' ' + doing if doing else ''}; the first "
                    f"report names this rank as the one the others wait for:\n  {first}\n"
                    + self.main_thread_stack())
        return message if self.announces else ""  # the same line on every waiting rank

    def _overrun_key(self, block: _Block) -> str:
        """The store key of this deadline of `block`, the same in every member waiting in
        it: its first check-in's group, name and call number, and the deadline's round."""
        point, count, members = block.points[0]
        return f"{KEY_PREFIX}/overrun/{_group_id(members)}/{point}/{count}/{block.rounds}"

    def _done_with(self, block: _Block, key: str) -> None:
        """This rank will not read or write the keys of the overrun `key` of `block` again
        (the run goes on: the verdict gave it more time, or it left the block): count it
        done there; the last of the block's members to be done removes the overrun's
        keys. Every member must have counted itself in (each does once per overrun, and
        before it counts done), so no one creates them anew. A member whose block ends
        before its deadline passes never counts done: the first member done leaves the
        overrun to `sweep_overruns` (best effort, as every store call here)."""
        point, count, members = block.points[0]
        try:
            done = int(self.store.add(f"{key}/done", 1))
            if done == len(members):
                self._remove_overrun(key)
            elif done == 1:
                self._left_overruns.append([key, point, count, members, SWEEP_LOOKS])
        except Exception:  # no store, or one without delete_key: the keys stay
            pass

    def sweep_overruns(self) -> None:
        """Remove the keys of the overruns this rank was the first member done with, once
        no member needs them: every member has gone on to a later call of the block (its
        published count there is higher), so its deadline in that call can no longer
        pass. Those the last member done removed are forgotten, and so are those still
        needed after SWEEP_LOOKS looks (their keys stay). A few store requests per such
        overrun and look; the monitor calls it every `poll_s`."""
        for left in list(self._left_overruns):
            key, point, count, members, looks = left
            try:
                if self.store.check([f"{key}/done"]):
                    read: dict = {}
                    self._read_checkins(_Block(0.0, "", ((point, count, members),), None), read)
                    needed = (len(read) < len(members) - 1 or
                              self.missing_ranks(point, count + 1, members, read))
                    if needed and looks > 1:
                        left[4] -= 1
                        continue  # a member may still be in that call of the block
                    if not needed:
                        self._remove_overrun(key)
            except Exception:  # no store, or one without delete_key: the keys stay
                pass
            self._left_overruns.remove(left)

    def _remove_overrun(self, key: str) -> None:
        """Remove the keys of the overrun `key` (its election count, verdict, done count)."""
        for part in ("reporter", "verdict", "done"):
            self.store.delete_key(f"{key}/{part}")

    def _count_in(self, key: str) -> bool:
        """Whether this rank is the first to count itself in `key` (an atomic count in the
        store; True when the store cannot be read: each rank then reports alone)."""
        try:
            return int(self.store.add(key, 1)) == 1
        except Exception:
            return True

    def _await_verdict(self, block: _Block, key: str) -> Optional[str]:
        """The verdict the reporting member of this overrun leaves under `key`/verdict (a
        report's first line, or AGAIN); None when `block` ends or the watchdog closes
        first; '' when none comes within the reporter's longest wait (min(EXCHANGE_S,
        timeout_s)) and VERDICT_WAIT_S more, or the store fails. Leaves this rank's
        collective counts first, for a block with `progress`; looks for the verdict
        less and less often (up to once a second), publishing meanwhile."""
        if block.progress is not None:
            try:
                self._leave_progress(block)
            except Exception:  # no count here, or no store: the reporter names none
                pass
        give_up = time.monotonic() + min(EXCHANGE_S, self.timeout_s) + VERDICT_WAIT_S
        pause = 0.05
        while True:
            try:
                if self.store.check([f"{key}/verdict"]):
                    return self.store.get(f"{key}/verdict").decode(errors="replace")
            except Exception:
                return ""
            if time.monotonic() >= give_up:
                return ""
            if not self._still_in(block, pause):
                return None
            pause = min(2 * pause, 1.0)

    def _first_to_fire(self) -> bool:
        """Whether no other rank's report came before this one's (FIRED_KEY)."""
        return self._count_in(FIRED_KEY)

    def _abort_line(self) -> str:
        """The first report's line under ABORT_KEY ('' when not there yet, or no store):
        the rank that fired first leaves it right after counting itself in FIRED_KEY."""
        for _ in range(10):
            try:
                if self.store.check([ABORT_KEY]):
                    return self.store.get(ABORT_KEY).decode(errors="replace")
            except Exception:
                return ""
            time.sleep(0.05)
        return ""

    def _leave(self, key: str, line: str) -> None:
        """Leave `line` under `key` for the other ranks' watchdogs (best effort: the
        store may be gone)."""
        try:
            self.store.set(key, line)
        except Exception:
            pass

    def _doing(self) -> str:
        if self.describe is None:
            return ""
        try:
            return self.describe()
        except Exception:  # the report matters more than this detail
            return ""

    def main_thread_stack(self) -> str:
        """Where the main thread is: its innermost STACK_FRAMES frames, innermost last."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return f"  rank {self.rank}'s main thread: unknown"
        frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
        lines = [f"  rank {self.rank}'s main thread is here (innermost last):"]
        for f in frames:
            lines.append(f"    {f.filename}:{f.lineno} in {f.name}" +
                         (f": {f.line.strip()}" if f.line else ""))
        return "\n".join(lines)

    def timeout_message(self, name: str, count: int, ranks: Sequence[int]) -> str:
        """The message for `name` (reached `count` times here) not completing in time."""
        return self.overrun_report(_Block(0.0, name, ((name, count, tuple(ranks)),), None))[0]

    def overrun_report(self, block: _Block) -> Optional[Tuple[str, List[int]]]:
        """(the message for `block` not completing in time, the ranks it names); None
        when it has `progress` and every member, inside it, has issued as many
        collectives: they are all computing (a first micro-batch that compiles the
        layers can outlast the timeout) -- or all wait in one collective that is itself
        stuck, which the process group's own timeout ends."""
        read: dict = {}
        try:
            self._read_checkins(block, read)
            late = [(point, count, ranks, r) for point, count, ranks in block.points
                    for r in self.missing_ranks(point, count, ranks, read)]
            # A rank publishes its check-ins every publish_s: one stuck since (SIGSTOP, a
            # dead node) may have reached the point more often than its last publication.
            lines = [f"  rank {r} reached '{point}' {self._reached(point, r, ranks, read)} "
                     f"times by its last published check-ins (published every "
                     f"{self.publish_s:g} s, so it may have got further); this rank is at its "
                     f"call number {count}"
                     for point, count, ranks, r in late]
        except Exception as exc:  # the store itself is gone (rank 0 died)
            return (f"[watchdog rank {self.rank}] collective {block.name} did not complete "
                    f"within {self.timeout_s:g} s; the rendezvous store cannot be read ({exc}), "
                    "so the ranks that did not arrive are unknown (rank 0, which hosts it, may "
                    "be dead)"), []
        missing = sorted({r for *_, r in late})
        if not missing and block.progress is not None:
            behind = self._behind(block)
            if behind is None:
                return None
            missing, lines = behind
        head = self._report_head(block, missing)
        if not missing:
            lines.append("  every rank arrived: the collective itself is stuck (network or "
                         "NCCL trouble, or ranks issuing collectives in different orders), or "
                         "a rank is stuck inside the block before its collective (its own "
                         "report says where)")
        return "\n".join([head] + lines), missing

    def _read_checkins(self, block: _Block, read: dict) -> None:
        """Read the other members' published check-ins of each group of `block` into
        `read` (as `_reached` keeps them) with one `check` and one `multi_get` per group;
        a group where one has published none is left to `_reached` (one rank at a time)."""
        for members in {ranks for _, _, ranks in block.points}:
            others = [r for r in members if r != self.rank]
            keys = [_checkin_key(_group_id(members), r) for r in others]
            if keys and self.store.check(keys):
                for r, raw in zip(others, _get_all(self.store, keys)):
                    read[r, members] = json.loads(raw)

    def _report_head(self, block: _Block, missing: List[int]) -> str:
        doing = self._doing()
        return (f"[watchdog rank {self.rank}] collective {block.name} did not complete within "
                f"{self.timeout_s:g} s{' ' + doing if doing else ''}; ranks that did not "
                f"arrive: {missing}")

    def _behind(self, block: _Block) -> Optional[Tuple[List[int], List[str]]]:
        """Every member reached `block`: compare how many collectives each has issued on
        each group of the block (`block.progress`: one count, or one per group, see
        `issued_collectives_on`). This rank, the one reporting the overrun, leaves its
        counts in the store and waits (up to EXCHANGE_S, or the timeout, while the block
        lasts) for the other members' -- each leaves its own when its deadline in the
        same block passes, at about the same time since they entered it together --,
        publishing its check-ins meanwhile and looking for theirs with one store request
        a look (`_read_progress`). Returns (the members behind the others of one of their
        groups, lines saying so), or None when every member answered with the same counts
        per group, or this rank left the block meanwhile (it was slow, not stuck)."""
        members = block.points[0][2]
        try:
            key, tag, mine = self._leave_progress(block)
            if mine is None:
                return [], []
            issued, nested = {self.rank: mine}, {self.rank: self._nested_in(block)}
            give_up = time.monotonic() + min(EXCHANGE_S, self.timeout_s)
            pause = FIRST_LOOK_S
            while len(issued) < len(members):
                if not self._still_in(block, min(pause, max(0.0, give_up - time.monotonic()))):
                    return None
                last = time.monotonic() >= give_up
                self._read_progress(key, tag, [r for r in members if r not in issued],
                                    issued, nested, last)
                if last:
                    break
                pause = min(2 * pause, MAX_LOOK_S)
        except Exception:  # no number here or no store: the plain report
            return [], []
        # a member behind because it waits in a watched block nested in this one is left
        # to that block's overrun, which names the rank it waits for: this block gets
        # more time, and the nested one (it began later) comes due meanwhile
        behind, lines = _behind_in_groups(issued, nested)
        silent = [r for r in members if r not in issued]
        if not silent and not behind:
            return None
        if silent:
            lines.append(f"  {_ranks_text(silent)} did not say from inside the block how many "
                         "collectives it issued (it may have left it: with asynchronous "
                         "collectives, NCCL's, a rank goes on once it has issued them)")
        return behind, lines

    def _read_progress(self, key: str, tag: str, waiting: List[int],
                       issued: Dict[int, List[list]], nested: Dict[int, Optional[str]],
                       last: bool) -> None:
        """One look for the counts of the members `waiting` (their keys under `key`):
        one `check` of all their keys and, when all are there, one `multi_get`; the
        counts left for this deadline (`tag`) go into `issued`, the watched block each
        waits in inside this one (or None) into `nested`. Their keys may hold an
        earlier overrun's counts (a tag that differs): those members are looked for
        again. `last`: the wait ends, read whichever keys are there (one check each)."""
        keys = [f"{key}{r}" for r in waiting]
        if self.store.check(keys):
            present = waiting
        elif last:
            present = [r for r, k in zip(waiting, keys) if self.store.check([k])]
        else:
            return
        for r, raw in zip(present, _get_all(self.store, [f"{key}{r}" for r in present])):
            their_tag, counts, *inside = json.loads(raw)
            if their_tag == tag:
                issued[r], nested[r] = counts, (inside or [None])[0]

    def _leave_progress(self, block: _Block) -> Tuple[str, str, Optional[List[list]]]:
        """Leave how many collectives this rank issued on the groups of `block` (its
        `progress`), and the watched block it waits in inside `block` if any, under its
        key for this deadline of the block; (the members' key prefix, this deadline's
        tag, the counts: None for none). Raises when the store or `progress` fails."""
        point, count = block.points[0][:2]
        tag = f"{count} {block.rounds}"  # this call of the block, this deadline
        mine = _issued_by_group(block.progress())
        key = f"{KEY_PREFIX}/progress/{point}/rank"
        if mine is not None:
            self.store.set(f"{key}{self.rank}",
                           json.dumps([tag, mine, self._nested_in(block)]))
        return key, tag, mine

    def _nested_in(self, block: _Block) -> Optional[str]:
        """The name of the innermost watched block this rank runs inside `block` (the
        forward's wait for --overlap-param-gather's all-gather), None when none."""
        with self._cond:
            active = list(self._active)
        inner = active[active.index(block) + 1:] if block in active else []
        return inner[-1].name if inner else None


def published_checkins(store, rank: int, ranks: Sequence[int]) -> Dict[str, int]:
    """What `rank`'s watchdog last published of its check-ins with the group `ranks`
    ({name: how many times it reached it}; {} before it published any)."""
    key = _checkin_key(_group_id(tuple(ranks)), rank)
    if not store.check([key]):  # get() would wait for it
        return {}
    return json.loads(store.get(key))


def _get_all(store, keys: List[str]) -> list:
    """The values of `keys`, all in the store: one `multi_get` where the store has it."""
    if not keys:
        return []
    if hasattr(store, "multi_get"):
        return store.multi_get(keys)
    return [store.get(k) for k in keys]


def _checkin_key(group: str, rank: int) -> str:
    return f"{KEY_PREFIX}/checkins/{group}/rank{rank}"


@functools.lru_cache(maxsize=1024)
def _group_id(ranks: Tuple[int, ...]) -> str:
    """A short name of the set of `ranks`, the same in every member (a transfer's two
    ends list its ranks in opposite orders)."""
    text = ",".join(map(str, sorted(set(ranks))))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _issued_by_group(progress) -> Optional[List[list]]:
    """A block's `progress()` as [label, group id, count] triples: one count (the block's
    one group, "its group") or those of `issued_collectives_on`; None for no count."""
    if progress is None or isinstance(progress, list):
        return progress or None
    return [["its group", "", int(progress)]]


def _behind_in_groups(issued: Dict[int, List[list]],
                      nested: Optional[Dict[int, Optional[str]]] = None
                      ) -> Tuple[List[int], List[str]]:
    """The ranks that issued fewer collectives on one of their groups than another member
    of that group ({rank: its [label, group id, count] triples}), and lines saying so;
    not those waiting in a nested watched block (`nested`: {rank: its name, or None}).
    Counts are compared only within a group: two data-parallel groups of different
    pipeline stages issue different numbers of collectives."""
    nested = nested or {}
    groups: Dict[str, Tuple[str, Dict[int, int]]] = {}
    for rank, counts in issued.items():
        for label, group, n in counts:
            groups.setdefault(group, (label, {}))[1][rank] = int(n)
    behind, lines = set(), []
    for label, got in groups.values():
        most = max(got.values())
        ahead = _ranks_text(sorted(r for r, n in got.items() if n == most))
        for r in sorted(r for r, n in got.items() if n < most and not nested.get(r)):
            behind.add(r)
            lines.append(f"  every rank entered it, but rank {r} has issued {got[r]} "
                         f"collectives on {label} and {ahead} {most}: rank {r} did not reach "
                         "the collective the others wait in")
    return sorted(behind), lines


def _named_in(line: str) -> List[int]:
    """The ranks a report's first line names as not arrived ([] for none, or another
    line)."""
    found = re.search(r"ranks that did not arrive: \[([\d, ]*)\]", line)
    return [int(r) for r in found[1].split(",") if r.strip()] if found else []


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def issued_collectives(group) -> Optional[Callable[[], Optional[int]]]:
    """A `progress` for `watch`: how many collectives and point-to-point transfers this
    rank has issued on `group` so far, as the backend counts them (a private
    torch.distributed call that gloo and NCCL groups answer; counted when issued, so a
    rank waiting in a collective has counted it and a rank stuck before it has not).
    None when the group has no such count."""
    count = getattr(group, "_get_sequence_number_for_group", None)
    if count is None:
        return None

    def issued() -> Optional[int]:
        try:
            return int(count())
        except Exception:  # a backend without the count
            return None

    return issued


def issued_collectives_on(groups: Sequence[Tuple[str, object]]) -> Callable[[], Optional[list]]:
    """A `progress` for a block whose collectives run on several groups (the distributed
    optimizer's step: its norm over all ranks, its parameter all-gather over the
    data-parallel group), from (label for the report, process group) pairs: the counts
    of `issued_collectives` per group, each compared only with the other members of the
    same group (a rank stuck between a collective of one group and one of another is
    level with the others on the first). The groups' ranks are read only when the block
    overruns."""
    def issued() -> Optional[list]:
        import torch.distributed as dist

        out = []
        for label, group in groups:
            count = issued_collectives(group)
            n = count() if count is not None else None
            if n is not None:
                ranks = tuple(dist.get_process_group_ranks(group))
                # the label too: two groups may have the same ranks (all ranks, dp at tp=pp=1)
                out.append([label, f"{label} {_group_id(ranks)}", n])
        return out or None

    return issued
