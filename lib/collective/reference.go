package collective

import (
	"fmt"
	"slices"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// ReferenceAllReduce returns the bytes AllReduce leaves on every member of
// a bridge of members members whose inputs are inputs (one per member, of
// one length) and whose Options.SmallBytes is the default: it is
// ReferenceAllReduceAlgo of the algorithm such a call runs (a direct call
// gives the bits of the one it replaces). It panics on arguments AllReduce
// would refuse (it is meant for tests and selftests).
func ReferenceAllReduce(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) []byte {
	checkRef(op, dt, inputs, members)
	return ReferenceAllReduceAlgo(exactAlgo(members, len(inputs[0]), DefaultSmallBytes), op, dt, inputs, members)
}

// ReferenceAllReduceAlgo returns the bytes an all_reduce that runs algo
// leaves on every member (Comm.AllReduceOrder says which algorithm's
// order a Comm's call follows), computed one element range at a time in
// the order the package documentation gives:
//
//   - AlgoLocal, AlgoExchange (1 or 2 members): reduce.Reference,
//     ((x0 op x1)), then Finish;
//   - AlgoRing (3 or more; 2 members keep AlgoExchange's order): the
//     buffer is cut into members segments of ceil(E/members) elements (E elements in all; the last segments may
//     be shorter or empty), and segment j is reduced in the order x[j+1],
//     x[j+2], ..., x[members-1], x[0], ..., x[j] (member indices mod
//     members), the partial always the earlier operand, then Finish;
//   - AlgoDirect, AlgoDirectWrite: the order of AlgoExchange for 2
//     members, of AlgoRing for more;
//   - AlgoRecursiveDoubling: with p the largest power of two at most
//     members, each x[r] of r >= p is folded into x[r-p] (x[r-p] op x[r]),
//     then in round i = 0, 1, ... each pair r < r+2^i of the first p
//     (r's bit i clear) becomes partial(r) op partial(r+2^i), then Finish.
//
// It panics on an algorithm that is none of these, one that does not run
// on members members, or arguments AllReduce would refuse.
func ReferenceAllReduceAlgo(algo string, op reduce.Op, dt reduce.DType, inputs [][]byte, members int) []byte {
	checkRef(op, dt, inputs, members)
	if algo == AlgoDirect || algo == AlgoDirectWrite || algo == AlgoRing && members == 2 {
		algo = map[bool]string{true: AlgoExchange, false: AlgoRing}[members <= 2]
	}
	switch {
	case algo == AlgoLocal && (members == 1 || len(inputs[0]) == 0), algo == AlgoExchange && members <= 2:
		out, err := reduce.Reference(op, dt, inputs)
		if err != nil {
			panic(err)
		}
		return out
	case algo == AlgoRing && members >= 2:
		L := len(inputs[0])
		out := make([]byte, L)
		segOff, segLen := ringSegments(L, dt.Size(), members)
		for j := range members {
			lo, hi := segOff(j), segOff(j)+segLen(j)
			ringOrder(op, dt, out[lo:hi], inputs, j, lo, hi)
		}
		return out
	case algo == AlgoRecursiveDoubling && members >= 2:
		return rdOrder(op, dt, inputs)
	}
	panic(fmt.Sprintf("collective: reference all_reduce: algorithm %q does not run on %d members", algo, members))
}

// rdOrder is the recursive-doubling all_reduce of inputs, whole buffers at
// a time: the fold, the rounds, Finish.
func rdOrder(op reduce.Op, dt reduce.DType, inputs [][]byte) []byte {
	sh := newRDShape(len(inputs))
	part := make([][]byte, sh.p)
	for r := range sh.p {
		part[r] = slices.Clone(inputs[r])
	}
	for e := sh.p; e < sh.n; e++ {
		mustCombineRef(op, dt, part[e-sh.p], part[e-sh.p], inputs[e])
	}
	// After round i every member of a block of 2^(i+1) holds the
	// block's partial: part[] keeps it at the block's first member.
	for i := range sh.k {
		for r := 0; r < sh.p; r += 2 << i {
			mustCombineRef(op, dt, part[r], part[r], part[r+1<<i])
		}
	}
	if err := reduce.Finish(op, dt, part[0], sh.n); err != nil {
		panic(err)
	}
	return part[0]
}

func mustCombineRef(op reduce.Op, dt reduce.DType, dst, a, b []byte) {
	if err := reduce.Combine(op, dt, dst, a, b); err != nil {
		panic(err)
	}
}

// ReferenceReduceScatter returns the out of every member of ReduceScatter
// (result[m] is member m's), for inputs of members × segment bytes each:
// segment m reduced in the order x[0], x[1] for 2 members, and x[m+1],
// x[m+2], ..., x[m] (mod members) for 3 or more, then Finish. It panics on
// arguments ReduceScatter would refuse.
func ReferenceReduceScatter(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) [][]byte {
	checkRef(op, dt, inputs, members)
	L := len(inputs[0]) / members
	if L*members != len(inputs[0]) || L%dt.Size() != 0 {
		panic(fmt.Sprintf("collective: reference reduce_scatter: input of %d bytes is not %d segments of whole %s elements", len(inputs[0]), members, dt))
	}
	res := make([][]byte, members)
	for m := range members {
		res[m] = make([]byte, L)
		if members <= 2 {
			seg := make([][]byte, members)
			for i := range seg {
				seg[i] = inputs[i][m*L : (m+1)*L]
			}
			out, err := reduce.Reference(op, dt, seg)
			if err != nil {
				panic(err)
			}
			res[m] = out
			continue
		}
		ringOrder(op, dt, res[m], inputs, m, m*L, (m+1)*L)
	}
	return res
}

// ringOrder sets dst to inputs[*][lo:hi] reduced in ring order for segment
// j: members j+1, ..., j (mod len(inputs)), then Finish.
func ringOrder(op reduce.Op, dt reduce.DType, dst []byte, inputs [][]byte, j, lo, hi int) {
	n := len(inputs)
	copy(dst, inputs[mod(j+1, n)][lo:hi])
	for k := 2; k <= n; k++ {
		if err := reduce.Combine(op, dt, dst, dst, inputs[mod(j+k, n)][lo:hi]); err != nil {
			panic(err)
		}
	}
	if err := reduce.Finish(op, dt, dst, n); err != nil {
		panic(err)
	}
}

func checkRef(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) {
	if err := reduce.Supported(op, dt); err != nil {
		panic(err)
	}
	if members < 1 || len(inputs) != members {
		panic(fmt.Sprintf("collective: reference: %d inputs for %d members", len(inputs), members))
	}
	for i, in := range inputs {
		if len(in) != len(inputs[0]) || len(in)%dt.Size() != 0 {
			panic(fmt.Sprintf("collective: reference: input %d has %d bytes, input 0 %d, element size %d", i, len(in), len(inputs[0]), dt.Size()))
		}
	}
}
