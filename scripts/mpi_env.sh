# Source me: settings that let the Open MPI wheel run a few ranks on a small machine.
# Root needs explicit consent from Open MPI; more ranks than cores needs oversubscription.
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo
export OMP_NUM_THREADS=1
# Ranks waiting in MPI yield the core instead of busy-polling: with more ranks than cores,
# polling ranks starve the ones still computing.
export OMPI_MCA_mpi_yield_when_idle=1
