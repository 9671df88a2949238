//go:build race

package codec

// raceOn: the race detector slows the kernels' Go code about tenfold; the
// sampled tests take fewer samples.
const raceOn = true
