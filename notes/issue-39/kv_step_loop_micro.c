#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <math.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// token-major int8 pool [L][S][H][D] read like attn512q::attend_quant's score loop, pieces switched on by mode bits:
// 1: slot through a block table with a runtime division, 2: fp16 scale per row, 4: scores array [8*S] refilled
int main(int argc,char**argv){
  int L=atoi(argv[1]), S=atoi(argv[2]), bs=atoi(argv[3]), H=3, D=64;
  size_t n=(size_t)L*S*H*D; int8_t* a=aligned_alloc(64,n); for(size_t i=0;i<n;i++)a[i]=(int8_t)(i*7);
  uint16_t* sc=malloc(2*(size_t)L*S*H); for(size_t i=0;i<(size_t)L*S*H;i++)sc[i]=0x3c00;
  int32_t* table=malloc(4*(S/bs+1)); for(int j=0;j<=S/bs;j++)table[j]=j;
  float q[3*64]; for(int i=0;i<192;i++)q[i]=i*0.01f;
  float* scores=malloc(sizeof(float)*8*S);
  for(int mode=0;mode<8;mode++){
    double best=1e9;
    for(int rep=0;rep<3;rep++){
      double t0=now(); float sink=0;
      for(int l=0;l<L;l++) for(int h=0;h<H;h++){
        if(mode&4) for(int i=0;i<8*S;i++) scores[i]=-INFINITY;
        for(long i=0;i<S;i++){
          long slot = (mode&1) ? (long)table[i/bs]*bs + i%bs : i;
          const int8_t* row = a+(((size_t)l*S+slot)*H+h)*D;
          float s = (mode&2) ? _cvtsh_ss(sc[((size_t)l*S+slot)*H+h]) : 1.0f;
          __m512 vs=_mm512_set1_ps(s), kc[4];
          for(int c=0;c<4;c++) kc[c]=_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row+16*c)))),vs);
          for(int u=0;u<3;u++){ __m512 acc=_mm512_mul_ps(_mm512_loadu_ps(q+u*64),kc[0]);
            for(int c=1;c<4;c++) acc=_mm512_fmadd_ps(_mm512_loadu_ps(q+u*64+16*c),kc[c],acc);
            scores[u*S+i]=_mm512_reduce_add_ps(acc);}
        }
        sink+=scores[S-1];
      }
      double t=now()-t0; if(t<best)best=t; if(sink==12345)puts("x");
    }
    printf("mode %d (table %d scale %d fill %d): %.2f ms, %.1f ns/row\n", mode, mode&1, (mode>>1)&1, (mode>>2)&1, best*1e3, best*1e9/((double)L*S*H));
  }
}
