// The decode attention kernel's KV reads with a stand-in for its arithmetic (session 38): 48 sequences x 1,050
// tokens x 30 layers in the engine's cache layout (a block holds every layer's K and V: [30][2][16 tokens][384 B]),
// block tables shuffled, 2 OpenMP threads, best of 5.
//
//   gcc -O2 -mavx512f -fopenmp kv_reads.c -o kv_reads && OMP_NUM_THREADS=2 ./kv_reads MODE PF C [DIST]
//
// MODE 0: each 32-token chunk read token by token (a row's 6 lines in order); MODE 1: the kernel's order (a KV
// head's 2 lines of every token, 3 times for its query heads in the K pass, once in the V pass).
// PF 0: no software prefetch; 1: the rows DIST tokens ahead (default 64) prefetched in one burst before each
// chunk (the kernel before); 2: a row per token of the first head's sweep; 3: spread evenly over every token
// iteration of the chunk (the kernel after). C: rounds of 4 FMAs after each pair of loads (the arithmetic).
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define L 30
#define BLK (L*2*16*384L)
int main(int argc,char**argv){
  int mode=atoi(argv[1]), pf=atoi(argv[2]); int C=atoi(argv[3]); int pdist=argc>4?atoi(argv[4]):64; int B=48, NB=66, T=1050;
  long nblocks=B*NB+8; char*buf=aligned_alloc(4096,nblocks*BLK);
  #pragma omp parallel for
  for(long i=0;i<nblocks*BLK;i+=4096) memset(buf+i,1,4096);
  int*ids=malloc(nblocks*4); for(int i=0;i<nblocks;i++) ids[i]=i;
  srand(1); for(int i=nblocks-1;i>0;i--){int j=rand()%(i+1);int t=ids[i];ids[i]=ids[j];ids[j]=t;}
  double best=1e9; __m512 tot=_mm512_setzero_ps();
  for(int rep=0;rep<5;rep++){
    double t0=now();
    for(int l=0;l<L;l++){
    #pragma omp parallel
    {
      __m512 a0=_mm512_setzero_ps(),a1=a0; __m512 w0=a0,w1=a0,w2=a0,w3=a0; const __m512 m=_mm512_set1_ps(0.999f);
      const char* rows[1100];
      #pragma omp for schedule(static)
      for(int s=0;s<B;s++){
        for(int pass=0;pass<2;pass++){
          for(int t=0;t<T;t++) rows[t]=buf+(long)ids[s*NB+t/16]*BLK+(long)l*2*16*384+pass*16*384+(t%16)*384;
          for(int c0=0;c0<T;c0+=32){
            int c1=c0+32<T?c0+32:T;
            if(pf==1) for(int t=c0+pdist;t<c1+pdist && t<T;t++) for(int o=0;o<384;o+=64) _mm_prefetch(rows[t]+o,_MM_HINT_T0);
            if(mode==0){
              for(int t=c0;t<c1;t++) { if(pf==2 && t+pdist<T) for(int o=0;o<384;o+=64) _mm_prefetch(rows[t+pdist]+o,_MM_HINT_T0);
              for(int o=0;o<384;o+=128){
                a0=_mm512_add_ps(a0,_mm512_load_ps((const float*)(rows[t]+o)));
                a1=_mm512_add_ps(a1,_mm512_load_ps((const float*)(rows[t]+o+64)));
                for(int k=0;k<C;k++){w0=_mm512_fmadd_ps(a0,m,w0);w1=_mm512_fmadd_ps(a1,m,w1);w2=_mm512_fmadd_ps(a0,m,w2);w3=_mm512_fmadd_ps(a1,m,w3);}}}
            } else {
              int a0t=c0+pdist<T?c0+pdist:T, a1t=c1+pdist<T?c1+pdist:T; int total=(a1t-a0t)*6, iters=3*(pass?1:3)*(c1-c0), it=0, cur=0;
              for(int h=0;h<3;h++) for(int g=0;g<(pass?1:3);g++) for(int t=c0;t<c1;t++){
                if(pf==2 && h==0 && g==0 && t+pdist<T) for(int o=0;o<384;o+=64) _mm_prefetch(rows[t+pdist]+o,_MM_HINT_T0);
                if(pf==3){ ++it; int lim=(int)((long)it*total/iters); for(;cur<lim;cur++) _mm_prefetch(rows[a0t+cur/6]+(cur%6)*64,_MM_HINT_T0);}
                a0=_mm512_add_ps(a0,_mm512_load_ps((const float*)(rows[t]+h*128)));
                a1=_mm512_add_ps(a1,_mm512_load_ps((const float*)(rows[t]+h*128+64)));
                for(int k=0;k<C;k++){w0=_mm512_fmadd_ps(a0,m,w0);w1=_mm512_fmadd_ps(a1,m,w1);w2=_mm512_fmadd_ps(a0,m,w2);w3=_mm512_fmadd_ps(a1,m,w3);}}
            }
          }
        }
      }
      #pragma omp critical
      tot=_mm512_add_ps(tot,_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(_mm512_add_ps(w0,w1),_mm512_add_ps(w2,w3))));
    }}
    double s=now()-t0; if(s<best)best=s;
  }
  double bytes=(double)B*T*L*2*384;
  printf("mode %d pf %d: %.1f ms %.1f GB/s\n",mode,pf,best*1e3,bytes/best/1e9);
  return _mm512_reduce_add_ps(tot)==0;
}
