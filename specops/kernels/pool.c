/* A persistent pool ----------------------------------------------------------------------
 * The output rows are cut into chunks of CHUNK_ROWS; the caller and the workers claim
 * chunks from one atomic ticket (job word | chunks | next), so a worker the OS has not
 * scheduled yet costs nothing: the caller takes its chunks. A job runs on at most the
 * `threads` it was given: the caller and workers 0 .. threads - 2. The job word carries
 * that helper count, and a worker whose index is not below it leaves the job alone (and
 * keeps sleeping, if it sleeps: each worker has its own condition variable, and the
 * caller signals only the helpers it wants). Workers spin a little after a job they took
 * part in (a decoding step calls every few tens of microseconds), then sleep. The caller
 * waits only for chunks already claimed, yielding the CPU while it waits.
 * Fixed-width types throughout: the ticket is a 64-bit word on every platform.
 */
#include "pool.h"

#define MAX_THREADS 64
#define SPIN_ROUNDS 4000 /* pause loops a worker spins before it sleeps (tens of microseconds) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define HELPER_BITS 8 /* low bits of a job word: how many workers may help (< MAX_THREADS) */
#define HELPER_MASK ((1u << HELPER_BITS) - 1u)
_Static_assert(MAX_THREADS <= (1 << HELPER_BITS), "a job word holds the helper count");
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t ticket; /* job word << 32 | chunks << 16 | next chunk */
static atomic_int done;
static _Atomic uint32_t generation; /* the job word: sequence number << HELPER_BITS | helpers */
static atomic_int helped; /* workers that ran at least one chunk of the last pooled job */
static atomic_int last_threads; /* threads (the caller included) that ran the last pooled job */
static int workers; /* started */
static struct {
    pthread_cond_t wake;
    atomic_int asleep;
    uint32_t start; /* the job word when it was started: jobs before it are not its own */
} slot[MAX_THREADS];

static int claim(uint32_t gen) { /* the next chunk of job `gen`, or -1 */
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        const uint32_t next = (uint32_t)(t & 0xffffu), chunks = (uint32_t)((t >> 16) & 0xffffu);
        if ((uint32_t)(t >> 32) != gen || next >= chunks) return -1;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) return (int)next;
    }
}

static void work(uint32_t gen, int helper) {
    int c, first = 1;
    while ((c = claim(gen)) >= 0) { /* the job is stable while a chunk of it is claimed and not done */
        if (helper && first) atomic_fetch_add(&helped, 1); /* before `done`: the caller sees it */
        first = 0;
        if (job_kind == JOB_LINEAR) {
            int64_t n0 = (int64_t)c * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS;
            run_rows(&job, n0, n1 < job.N ? n1 : job.N);
        } else {
            const int64_t rows = attn_job.B * attn_job.T * attn_job.Hq;
            int64_t r0 = (int64_t)c * job_chunk, r1 = r0 + job_chunk;
            attn_rows(&attn_job, r0, r1 < rows ? r1 : rows);
        }
        atomic_fetch_add(&done, 1);
    }
}

/* Whether job word `gen` is a new job (not `seen`) that worker `me` helps with. */
static inline int wanted(uint32_t gen, uint32_t seen, int me) {
    return gen != seen && (uint32_t)me < (gen & HELPER_MASK);
}

static void *worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = slot[me].start;
    for (;;) {
        int spins = 0;
        uint32_t gen;
        while (!wanted(gen = atomic_load(&generation), seen, me)) {
            seen = gen; /* a job without this worker: skipped, the spin count goes on */
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            atomic_store(&slot[me].asleep, 1); /* before the check below: pool_run sees it or we see the job */
            pthread_mutex_lock(&sleep_lock);
            while (!wanted(gen = atomic_load(&generation), seen, me)) pthread_cond_wait(&slot[me].wake, &sleep_lock);
            pthread_mutex_unlock(&sleep_lock);
            atomic_store(&slot[me].asleep, 0);
            break;
        }
        seen = gen;
        work(gen, 1);
    }
    return NULL;
}

static void after_fork_child(void) { /* the workers did not survive the fork */
    workers = 0;
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    for (int i = 0; i < MAX_THREADS; i++) {
        pthread_cond_init(&slot[i].wake, NULL);
        atomic_store(&slot[i].asleep, 0);
    }
}

static int ensure_workers(int wanted_workers) {
    static int registered = 0;
    if (!registered) {
        for (int i = 0; i < MAX_THREADS; i++) pthread_cond_init(&slot[i].wake, NULL);
        pthread_atfork(NULL, NULL, after_fork_child);
        registered = 1;
    }
    while (workers < wanted_workers && workers + 1 < MAX_THREADS) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        slot[workers].start = atomic_load(&generation);
        atomic_store(&slot[workers].asleep, 0);
        int rc = pthread_create(&tid, &attr, worker, (void *)(intptr_t)workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        workers++;
    }
    return workers;
}

/* The pool's workers started so far (they stay for the life of the process). */
int specops_pool_workers(void) { return workers; }

/* How many threads, the caller included, ran chunks of the last job split over the pool
 * (at most the job's `threads`; 0 before the first). */
int specops_pool_last_threads(void) { return atomic_load(&last_threads); }

/* Runs the job set in `job` / `attn_job` (kind, chunks) on the caller and threads - 1
 * workers (0 .. threads - 2; pool_take started them); the caller holds pool_lock. */
static void pool_run(int64_t chunks, int threads) {
    const uint32_t helpers = (uint32_t)(threads - 1 < workers ? threads - 1 : workers);
    atomic_store(&done, 0);
    atomic_store(&helped, 0);
    const uint32_t gen = ((atomic_load(&generation) >> HELPER_BITS) + 1u) << HELPER_BITS | helpers;
    atomic_store(&ticket, (uint64_t)gen << 32 | (uint64_t)chunks << 16);
    atomic_store(&generation, gen);
    for (uint32_t i = 0; i < helpers; i++) {
        if (!atomic_load(&slot[i].asleep)) continue; /* spinning: it sees the new word */
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_signal(&slot[i].wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    work(gen, 0);
    for (int spins = 0; atomic_load(&done) < chunks; spins++) {
        if (spins < 1000)
            cpu_relax();
        else
            sched_yield(); /* a worker holds a chunk but has no CPU: give it ours */
    }
    atomic_store(&last_threads, 1 + atomic_load(&helped));
    pthread_mutex_unlock(&pool_lock);
}

/* Takes the pool for a job of `chunks` chunks over `threads` threads; 0 when it should run
 * on the caller alone (one thread, one chunk, or another caller holds the pool). */
static int pool_take(int64_t chunks, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks < 2 || chunks > 0xffff || pthread_mutex_trylock(&pool_lock) != 0) return 0;
    if (ensure_workers(threads - 1) < 1) {
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    return 1;
}
