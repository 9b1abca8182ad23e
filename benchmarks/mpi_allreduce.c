/* One rank of the Open MPI peer of allreduce_bench: MPI_Allreduce of float32
 * sums timed exactly as allreduce_bench_worker times deepnex (2 warm-up runs,
 * a barrier before each timed run, enough runs to fill MIN_TIME seconds
 * (5..200), median), then checked exactly with integer-valued inputs.
 * Prints "SIZE_BYTES MEDIAN_SECONDS mpi" from rank 0, then "barrier SECONDS
 * mpi": the median of 7 rounds of 500 back-to-back MPI_Barrier calls.
 *   mpirun -np 2 mpi_allreduce 1024,65536 0.3 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 2) {
    if (rank == 0) fprintf(stderr, "usage: mpi_allreduce SIZES [MIN_TIME]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  double min_time = argc > 2 ? atof(argv[2]) : 0.3;
  char* sizes = strdup(argv[1]);
  for (char* tok = strtok(sizes, ","); tok != NULL; tok = strtok(NULL, ",")) {
    size_t bytes = strtoull(tok, NULL, 10), n = bytes / 4;
    float* x = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; ++i) x[i] = 1.0f;
    for (int w = 0; w < 2; ++w) MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double one = MPI_Wtime() - t0;
    int iters = (int)(min_time / (one > 1e-6 ? one : 1e-6));
    iters = iters < 5 ? 5 : iters > 200 ? 200 : iters;
    MPI_Bcast(&iters, 1, MPI_INT, 0, MPI_COMM_WORLD);
    double* times = malloc(iters * sizeof(double));
    for (int it = 0; it < iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      times[it] = MPI_Wtime() - t0;
    }
    for (size_t i = 0; i < n; ++i) x[i] = (float)(i % 1000 + rank);
    MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (size_t i = 0; i < n; ++i) {
      float want = (float)(world * (i % 1000) + world * (world - 1) / 2);
      if (x[i] != want) {
        fprintf(stderr, "rank %d: WRONG RESULT at element %zu of %zu bytes\n", rank, i, bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
    qsort(times, iters, sizeof(double), cmp_double);
    if (rank == 0) {
      printf("%zu %.9f mpi\n", bytes, times[iters / 2]);
      fflush(stdout);
    }
    free(times);
    free(x);
  }
  free(sizes);
  enum { kRounds = 7, kPerRound = 500 };
  double rounds[kRounds];
  for (int i = 0; i < 10; ++i) MPI_Barrier(MPI_COMM_WORLD);
  for (int k = 0; k < kRounds; ++k) {
    double t0 = MPI_Wtime();
    for (int i = 0; i < kPerRound; ++i) MPI_Barrier(MPI_COMM_WORLD);
    rounds[k] = (MPI_Wtime() - t0) / kPerRound;
  }
  qsort(rounds, kRounds, sizeof(double), cmp_double);
  if (rank == 0) printf("barrier %.9f mpi\n", rounds[kRounds / 2]);
  MPI_Finalize();
  return 0;
}
