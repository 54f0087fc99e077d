"""Course tooling, one module per job:

- `notebooks`: notebook sync and checks, and the student edition (`make lint`, `make notebooks`, `make student`);
- `compile_check`: every course kernel compiled for Hopper without a GPU (a test in `make test`);
- `run_notebooks`: every notebook run as a script on a GPU machine (`make test-gpu`)."""
