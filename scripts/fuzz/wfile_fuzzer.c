/* libFuzzer target for the weight-file parser (csrc/wfile.c), built by scripts/fuzz.sh with
 * clang -fsanitize=fuzzer,address,undefined. Each input is written to a file and opened with
 * clb_wfile_open, exactly as a model load does; what the parser accepts is then walked
 * end to end, so an offset it failed to bound reads past the mapping under ASan. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clb_model.h"

static char g_path[64];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_path[0]) snprintf(g_path, sizeof g_path, "/tmp/clb_wfile_fuzz.%d", (int)getpid());
    FILE *f = fopen(g_path, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);
    char err[CLB_ERR_LEN];
    clb_wfile *w = NULL;
    if (clb_wfile_open(g_path, &w, err) == CLB_OK) {
        volatile uint8_t sink = 0;
        for (int i = 0; i < clb_wfile_n_tensors(w); i++) {
            const clb_tensor *t = clb_wfile_tensor(w, i);
            const uint8_t *p = t->data;
            if (!p || t->nbytes == 0 || clb_wfile_find(w, t->name) == NULL) abort();
            sink ^= p[0] ^ p[t->nbytes - 1]; /* first and last byte must be mapped */
        }
        (void)sink;
        clb_wfile_close(w);
    } else if (!err[0]) {
        abort(); /* a refusal always says why */
    }
    return 0;
}
