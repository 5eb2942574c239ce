"""Keep a tritonserver serving: the supervisor that the ``tritonserver`` launcher runs beside it.

Triton 2.51 has four failure modes that its own health endpoints do not show (measured, see
shared notes and docs/reliability.md): a Python stub that dies is never replaced while
``/v2/health/ready`` and ``/v2/models/<m>/ready`` keep answering 200; a stub frozen with the GIL
held is still called healthy (its health thread is native) and requests queue for it forever; a
malformed request can abort the whole server (``std::bad_alloc`` on a JSON shape of 2^31); and
stubs of a dead server linger (ppid 1, ignoring SIGTERM, holding their shared memory). The
supervisor:

- runs tritonserver as its child, with ``PR_SET_PDEATHSIG`` so the server never outlives it,
  and makes itself a child subreaper so stubs orphaned by a dying server become its children;
- every ``poll_s`` lists the server's stub processes from ``/proc`` (``triton_python_backend_stub
  <repo>/<model>/<version>/model.py <shm region> … <instance>``); a stub that is gone or a zombie
  while its model is still loaded and no stub of the same instance replaced it (a reload starts
  the new one first) is dead: the model is reloaded through the repository API with its own
  config as override, its version folder's mtime moved on first (unchanged files and config
  would keep the old instances); new instances start, then the old ones are released (ensembles
  over it follow). That needs ``--model-control-mode=explicit`` (the launcher's default); in
  ``none``/``poll`` mode the whole server is restarted instead. Readiness is wrong only between
  the death and the end of the reload (detection ≤ ``poll_s`` + ``grace_s``). The load call is
  watched, not waited on: a server that dies during a reload is restarted at once;
- every ``stall_poll_s`` reads Triton's metrics: a model whose instances took no new execution
  for ``stall_s`` (60 s; ``TRITONGUARD_STALL_S``, 0 turns it off) while requests waited for it,
  and whose stubs used under a quarter of one CPU meanwhile, is frozen (python_backend 24.10 can deadlock a stub
  with the GIL held, docs/stream-guard.md; its health thread is native, so Triton still calls it
  healthy and requests queue forever): its idle stubs are killed and the model reloaded as for a
  dead stub, and so are the models it calls (``target``, ``target_per_version``, ``*.model``):
  their response sends to the killed caller never return. A model whose stubs are busy (a long
  execution) is left alone;
- when the server dies after having been live (a signal, an abort), kills its leftover stubs,
  removes their shared-memory regions and starts it again (backoff 1 s doubling to 30 s, reset
  after 60 s up), with a new advertised start time (``TRITONGUARD_ADVERTISE_STARTED``: the
  replica registry shows the restart, whose counters start from zero); a server that dies before it was ever live exits the supervisor with its code
  (a bad flag or repository is not retried forever);
- forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to the server, waits for it, kills its leftover stubs,
  and exits with its code.

One line per event goes to stderr (``tritonguard supervisor: …``), beside Triton's log.

Three modules, by collaboration: :mod:`.stubs` (the stub scan: stubs and their models read from
``/proc``), :mod:`.stall` (the frozen-stub check on Triton's metrics) and :mod:`.control` (the
supervise loop: flags, the repository API, reloads, restarts, signals; :func:`.control.supervise`
and :func:`.control.with_default_control` are the launcher's entries). They import only the
standard library and :mod:`tritonguard.triton.http`; control uses stall and stubs, stall uses stubs.
"""
