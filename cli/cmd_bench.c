/* Placeholder until the 'bench' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_bench(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("bench", fm_error(FM_E_UNSUPPORTED, "the 'bench' command is not built yet"));
}
