# Source me (after activating .venv): the Open MPI settings that let the Open MPI wheel run a
# few ranks on a small machine — consent to run as root, oversubscription, loopback TCP, one
# thread per rank, ranks that yield while they wait. The settings live in the package, so an
# installed user has them too: eval "$(commopt mpi-env)" (commopt/cli/mpi_env.py).
_commopt_mpi_env="$(python -m commopt.cli mpi-env)" && eval "$_commopt_mpi_env"
unset _commopt_mpi_env
