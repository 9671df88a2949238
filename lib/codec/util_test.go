package codec

import "os"

// exhaustive reports whether GPUBRIDGE_EXHAUSTIVE=1 asks for the long
// versions of the sampled tests.
func exhaustive() bool { return os.Getenv("GPUBRIDGE_EXHAUSTIVE") == "1" }
