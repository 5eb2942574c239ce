"""The lanes' shared tail (a pytest plugin of :mod:`tests.lanes`, loaded with ``-p tests.tail``).

Every lane collects the run's tail modules after its own, and runs each one only if it claims it
first: the claim is a file created with ``O_EXCL`` in the folder named by ``$TRITONGUARD_TAIL``
(its ``modules.txt`` lists the tail, one absolute path a line). A lane that ends its own modules
early takes more of the tail, so the lanes end within about one tail module of each other
whatever the recorded module times said. A lane claims a tail module once the module before it
has ended, never earlier: a lane holds no claim while one of its own modules runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.lanes import TAIL_ENV


def _mark(folder: Path, module: Path) -> Path:
    return folder / (str(module).strip("/").replace("/", "__") + ".claim")


def claim(folder: Path, module: Path) -> bool:
    """True for the first process that claims ``module`` in ``folder``, False for every other."""
    try:
        fd = os.open(_mark(folder, module), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    folder = os.environ.get(TAIL_ENV)
    if not folder or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        return None  # pytest's own loop, which stops the run on the collection errors
    folder_path = Path(folder)
    tail = {Path(p).resolve() for p in (folder_path / "modules.txt").read_text().split("\n") if p}
    groups: list[tuple[Path, list[pytest.Item]]] = []  # the items, module by module, in order
    for item in session.items:
        path = Path(item.path).resolve()
        if groups and groups[-1][0] == path:
            groups[-1][1].append(item)
        else:
            groups.append((path, [item]))
    decided: dict[Path, bool] = {}  # one decision per module, should its tests not come together

    def runs(module: Path) -> bool:  # claims a tail module
        if module not in decided:
            decided[module] = module not in tail or claim(folder_path, module)
        return decided[module]

    def taken(module: Path) -> bool:  # looks only
        if module in decided:
            return not decided[module]
        return module in tail and _mark(folder_path, module).exists()

    i = next((k for k, (module, _) in enumerate(groups) if runs(module)), None)
    while i is not None:
        items = groups[i][1]
        peek = None
        for j, item in enumerate(items):
            if j + 1 < len(items):
                nextitem = items[j + 1]
            else:  # pytest tears down what the next test does not share: the next module this lane
                # would run, not claimed yet (a lane holds no claim while its last test runs)
                peek = next((k for k in range(i + 1, len(groups)) if not taken(groups[k][0])), None)
                nextitem = groups[peek][1][0] if peek is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        i = next((k for k in range(i + 1, len(groups)) if runs(groups[k][0])), None)
        if i is not None and i != peek:  # another lane claimed the peeked module meanwhile
            session._setupstate.teardown_exact(groups[i][1][0])  # what pytest does for a nextitem
    return True
