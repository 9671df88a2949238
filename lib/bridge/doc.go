// Package bridge makes this process one member of the bridge between the
// island leaders: Join connects to the job's c10d store, sets up the mesh
// to the other members (transport.Establish) and runs a collective.Comm
// over it. `gbbridge serve` joins with the members that gbdiscover's
// topology names (ReadTopology, FromTopology); `gbbridge selftest` and
// `bench`, which run without discovery, let Join learn the members' hosts
// through the store.
package bridge
