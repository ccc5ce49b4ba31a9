"""`python -m proxy` runs the same CLI as the `tf-registry-proxy` script."""

from proxy.cli import main

raise SystemExit(main())
