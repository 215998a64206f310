import os

from trnrecipes.cli import main

if os.environ.get("TORCHELASTIC_ERROR_FILE"):
    # Under torchrun: an uncaught exception's traceback goes to torchrun's failure summary in the job log, also for
    # the ranks whose own output stays node-local (run.sbatch shows local rank 0 only).
    from torch.distributed.elastic.multiprocessing.errors import record

    main = record(main)

raise SystemExit(main())
