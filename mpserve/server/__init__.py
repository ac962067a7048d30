"""The server process: the broker and the supervisor in one poll loop. It never imports llama_cpp.

    preflight   what `mpserve start` checks before anything starts: the name, each address, the lock folder
    loop        serve(): claims the server name, builds the layout, runs broker + supervisor + watchdog
    broker      the broker's root: its sockets (clients, workers, operators), deadlines, drain, roll, hand-off;
                it composes the floors below, each importing only those under it:
      registry    worker messages: READY and trust, LEAVING, loss and retry (what a lost request becomes)
      results     a worker's CHUNKs, STEPs, DONEs and ERRORs to their clients, by ticket
      clients     client messages: admission, a request's tenant and limits, lookups, reattached requests
      adopter     the adopted instances' requests, held for their clients; the secrets local workers prove
      rebind      a gone client's live requests, run on and taken up by another client with the text they kept
      adapter_ops LoRA adapters loaded and unloaded at run time: to every instance, an unload after its requests
      dispatch    queued requests to free slots (routing, adapter batching), preemption and parking, drains
      answers     each request's one terminal message (DONE or ERROR); the clients' outbox
      tables      the shared tables: requests, workers, models, lookups, clients' counts; the workers' outbox
      journal     what a server that dies leaves of its live requests (a file), for the next start to go on with
    hooks       what the broker tells the server (READY, FAILED, drained) and asks of it: one object, given at
                construction
    spans       the broker's trace spans of a request: one for each wait for a slot (queue, preempted, hand-over,
                reattach), the parent of the worker's
    routing     the broker's decisions as pure functions: which slot a request goes to, what a lost one becomes
    tenants     per tenant: the order queued requests start in (priority, fair shares), limits and figures
    preemption  which running requests give their slots to waiting ones of higher priority (pure functions)
    link        the worker link's trust rules: whose READY, which name, whose answer (pure functions)
    roles       who may do what on the ZeroMQ side: a message's role is the socket it arrived on
    pool_keys   which models a remote pool's CURVE key may serve (``worker_models``)
    state       the rows of the broker's tables: requests, workers, models
    chat        which chat template the broker hands out for a model, and what a READY's template becomes
    adoption    a server that died: its instances hold their requests, its zygotes their weights; the next start
                adopts them (no model loads)
    unserved    how long a request waits while no instance of its model is up or loading, and what it is told
    ram_prefixes  what each instance's host store holds in RAM, from the CACHE frames of its DONEs and READY
    supervisor  starts (through a fork server), reaps and restarts worker processes (``mpserve.worker.spec.run``)
    zygotes     a model's zygote as the supervisor sees it: fork requests over a pipe, a handle per forked worker
    instances   each model's live instances: scaling decisions carried out, the control API (CONTROL)
    scaling     when a model's instance count changes: start on queueing, drain on idle, within min..max
    reload      what a reload (SIGHUP, ``mpserve reload``) changes: applied at once, models added, removed, scaled,
                rolled
    rolling     a model's instances replaced one at a time onto settings a reload changed (pure decisions)
    residency   single active backend: which model holds each GPU, and when they take turns
    layout      devices discovered, instances placed, worker specs built (also ``mpserve plan``)
    host_ram    whether the instances on the CPU fit the host's RAM (before anything starts, and in plan)
    pool        ``mpserve worker --connect``: a supervisor without a broker, for remote hosts
    signals     a self-pipe that turns signals into something the poll loop can wait on
    waiting     how the loop waits: busy polling for a moment after a message, where the server has CPU to spare
    cpu_idle    the idle CPU time the server could use: its CPUs' lines of /proc/stat, its cgroup's CPU quota
"""
