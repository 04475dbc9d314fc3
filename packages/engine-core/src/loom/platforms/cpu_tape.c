
/* ---- cpu_tape.c: a recorded decode step, replayed in one call ------------------------------
 *
 * A captured one-stream decode step (loom.worker.cpu_step_replay) is a list of about 300 calls
 * into this library and the paged-decode one, each with integer-class arguments (pointers,
 * strides, sizes, counts) and at most one float. Made one by one through ctypes they cost
 * about 1.5 us each in Python, 0.45 ms a step; tape_run makes a whole list in one call.
 *
 * Every kernel is called through one prototype: TAPE_INTS integer-class arguments and a float.
 * On the x86-64 (System V) and AArch64 (AAPCS64) calling conventions integer-class arguments
 * fill the integer registers and then the stack, in their order, whatever floats sit between
 * them, and a float goes in the first vector register wherever it is in the list: a kernel
 * reads exactly its own arguments, and the caller, who pushed the extra ones, removes them.
 * A 32-bit int argument is read from the low half of its register or slot. That holds for the
 * System V x86-64 ABI and Linux's AAPCS64, not for Apple's arm64 (stack arguments packed at their
 * own size) nor Windows x64 (arguments by position): elsewhere tape_op_size() is 0 and the
 * step's calls stay ctypes calls from Python. A wrong argument can crash the process rather than
 * fail the first replay's comparison with the eager step, hence the guard. */

#if (defined(__x86_64__) && !defined(_WIN32)) || (defined(__aarch64__) && !defined(__APPLE__))
#define TAPE_ABI_OK 1
#else
#define TAPE_ABI_OK 0
#endif

#define TAPE_INTS 20

typedef struct {
    void *fn;
    int64_t a[TAPE_INTS];
    float f;
    int32_t unused;
} tape_op;

typedef int (*tape_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, float);

/* sizeof(tape_op) where tape_run may be used, 0 where the calling convention does not allow it. */
int64_t tape_op_size(void) { return TAPE_ABI_OK ? (int64_t)sizeof(tape_op) : 0; }

/* Call ops[0..n) in order; 0, or the first non-zero return, its op's index in *failed. */
int tape_run(const tape_op *ops, int64_t n, int64_t *failed) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *a = ops[i].a;
        int rc = ((tape_fn)ops[i].fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
                                      a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], ops[i].f);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}
