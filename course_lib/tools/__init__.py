"""Course tooling: notebook sync and checks, and the student edition (`make lint`, `make student`)."""
