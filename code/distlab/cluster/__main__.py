"""``python -m distlab.cluster start|stop|restart|status|reset``."""

from distlab.cluster.cli import main

raise SystemExit(main())
