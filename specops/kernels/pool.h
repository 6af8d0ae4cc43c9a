/* The persistent thread pool (pool.c) that the linear layer and attention split their rows
 * over. A caller takes the pool (pool_take), sets the job below, then runs it (pool_run). */
#ifndef SPECOPS_POOL_H
#define SPECOPS_POOL_H
#include "kernel.h"
#include "gemv.h"
#include "attention.h"

#define CHUNK_ROWS 64 /* linear output rows per chunk */
static int job_kind; /* JOB_LINEAR or JOB_ATTENTION */
static int64_t job_chunk; /* attention rows per chunk */
static Job job;
static AttnJob attn_job;
enum { JOB_LINEAR, JOB_ATTENTION };

/* Takes the pool for a job of `chunks` chunks over `threads` threads; 0 when it should run
 * on the caller alone. */
static int pool_take(int64_t chunks, int threads);
/* Runs the job set above on the caller and threads - 1 workers, then gives the pool back. */
static void pool_run(int64_t chunks, int threads);

int specops_pool_workers(void);
int specops_pool_last_threads(void);
#endif
